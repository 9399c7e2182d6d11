"""The data layer's two exceptions (re-exported by diffjax.data.sources, where callers import them from)."""


class DataError(ValueError):
    """Unusable input data; the message names the file and the problem."""


class DataWarning(UserWarning):
    """Input data was repaired (undecodable bytes replaced) or partly skipped."""

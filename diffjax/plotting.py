"""matplotlib for the figures diffjax writes to files (reports, protocol plots, telemetry)."""

from __future__ import annotations

import sys


def pyplot():
    """`matplotlib.pyplot`, on the file-only Agg backend unless pyplot is in use already: a notebook's inline
    backend must survive a run that writes a figure (else every later `plt.show()` in it is blank)."""
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(*args, **kwargs):
    """`pyplot().subplots(...)`: a new figure and its axes."""
    return pyplot().subplots(*args, **kwargs)


def save(fig, path, dpi: int = 110, rect=None) -> None:
    """Lay `fig` out (within `rect`) unless it has a layout engine of its own, write it to `path` and close it."""
    if fig.get_layout_engine() is None:
        fig.tight_layout(rect=rect)
    from diffjax import paths

    paths.save_figure(fig, path, dpi=dpi)  # a run directory may be on object storage
    pyplot().close(fig)

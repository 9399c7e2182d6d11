"""A test hook for fault tests: `DIFFJAX_TEST_FAULT=SIGNAL@STEP` (e.g. "SIGKILL@25") makes a run send itself SIGNAL
once step STEP is done and that step's checkpoint, if it saved one, is complete — so a test kills or stops a run
exactly where it means to, instead of racing a timer against the run."""

from __future__ import annotations

import os
import signal

ENV = "DIFFJAX_TEST_FAULT"


def planned() -> tuple[signal.Signals, int] | None:
    """(signal, step) from the environment, or None."""
    value = os.environ.get(ENV)
    if not value:
        return None
    name, _, step = value.partition("@")
    try:
        return signal.Signals[name], int(step)
    except (KeyError, ValueError):
        raise ValueError(f"{ENV}={value!r}: expected SIGNAL@STEP, e.g. SIGKILL@25") from None


def deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)

"""A test hook for fault tests: `DIFFJAX_TEST_FAULT=SIGNAL@STEP` (e.g. "SIGKILL@25") makes a run send itself SIGNAL
once step STEP is done and that step's checkpoint, if it saved one, is complete — so a test kills or stops a run
exactly where it means to, instead of racing a timer against the run."""

from __future__ import annotations

import os
import signal

ENV = "DIFFJAX_TEST_FAULT"
# Where JAX's preemption notifier posts a SIGTERM for every process to see (xla/tsl's preemption_sync_manager.cc).
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
NOTICE_TIMEOUT_MS = 30_000


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
    if sig in (signal.SIGTERM, signal.SIGINT):
        _await_notice()


def _await_notice() -> None:
    """In a multi-process run, return once the stop request is posted to the coordination service, so that the
    processes agree on a step within a step or two of this one (JAX's notifier looks for a SIGTERM once a second;
    the steps of a test run are milliseconds). A notice that never comes fails the test here, in 30 s."""
    # jax._src: the coordination service's key-value store (blocking_key_value_get); no public API reads it
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is not None:
        client.blocking_key_value_get(NOTICE_KEY, NOTICE_TIMEOUT_MS)

"""When the loop stops early: at the step boundary after a SIGTERM or SIGINT; in a multi-process run, the same step
on every process, whichever process the signal reached and when.

One process: a Python handler sets a flag. Several: stopping on a flag of one's own leaves the others waiting in a
collective that the stopped process never joins, so the processes agree through JAX's coordination service, as
MaxText and Orbax do: `jax.distributed.initialize` installs JAX's preemption notifier as the SIGTERM handler; a
SIGTERM to any process is posted to the service, every process sends it the step it is at, and all stop at the
next step after the fastest (`multihost_utils.reached_preemption_sync_point`, asked at every step boundary). So
SIGTERM is left to JAX there, and a SIGINT is passed on to it as a SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal

import jax

from diffjax import distributed


class StopRequest:
    """`due(step)` at every step boundary, on every process: whether to stop (and checkpoint) here."""

    def __init__(self):
        self.multi = distributed.is_multi_process()
        self.signal: str | None = None  # the signal this process saw (one process: the one that stops it)
        self.agreed = False  # several processes: they agreed to stop at this boundary

    def due(self, step: int) -> bool:
        if not self.multi:
            return self.signal is not None
        from jax.experimental import multihost_utils

        self.agreed = multihost_utils.reached_preemption_sync_point(step)
        return self.agreed

    def describe(self, step: int, where: str = "") -> str:
        if not self.multi:
            return f"{self.signal} at step {step}{where}; checkpoint saved, rerun to resume"
        return (f"a SIGTERM or SIGINT to one of the {jax.process_count()} processes: all stopped at step {step}"
                f"{where}; checkpoint saved, rerun every process to resume")

    @property
    def stopped(self) -> bool:
        return self.agreed if self.multi else self.signal is not None

    @contextlib.contextmanager
    def installed(self):
        def handler(signum, _frame):
            self.signal = signal.Signals(signum).name
            signal.signal(signum, previous[signum])  # a second signal acts at once
            if self.multi:  # JAX's notifier listens for SIGTERM only
                os.kill(os.getpid(), signal.SIGTERM)

        # several processes: SIGTERM is JAX's notifier's (replacing its handler would undo the agreement)
        signals = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.getsignal(s) for s in signals}
        try:
            for s in previous:
                signal.signal(s, handler)
        except ValueError:  # not the main thread: no handlers, the run is stopped by its owner
            previous = {}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

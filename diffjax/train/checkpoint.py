"""Orbax checkpoints of a run: the train state and each process's data position, saved asynchronously, keeping the
last N; a damaged step is skipped (a writer moves it to `unreadable_checkpoints/`), another config's state refused, a
write the storage refuses ends the run with a `StorageError` (docs/design.md §3, "Checkpoints"; docs/training.md)."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from diffjax import distributed, paths
from diffjax.config import ConfigError


@contextlib.contextmanager
def _quiet_absl_warnings(quiet: bool):
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR if quiet else level)
    try:
        yield
    finally:
        logger.setLevel(level)


class StorageError(OSError):
    """The run's files could not be written where they belong."""


# How the storage refuses a write, as Orbax's and tensorstore's messages word it (their errors are not OSErrors).
_REFUSED = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied")


def quiet_background_errors() -> None:
    """Leave out Orbax's, asyncio's and tensorstore's reports of a failed save from their background threads: the
    failure reaches the main thread, which reports it once (a command line's choice; library users keep them)."""
    logging.getLogger("absl").addFilter(lambda record: record.levelno < logging.ERROR or "orbax" not in record.pathname)
    logging.getLogger("asyncio").addFilter(lambda record: "orbax" not in record.getMessage())
    report = sys.unraisablehook  # how the callbacks' errors are printed: they have nowhere to be raised

    def unraisablehook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            report(unraisable)

    sys.unraisablehook = unraisablehook


def _whole_arrays_on_cpu() -> None:
    """On CPU devices a replicated array is written whole by its first replica: replica-parallel saving dispatches a
    slice op per replica and leaf there (a fifth of a tiny sweep's time). Either layout restores into the other."""
    if jax.default_backend() == "cpu":
        with _quiet_absl_warnings(True):  # Orbax warns on every override; the choice is ours, not the user's news
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, async_save: bool = True, read_only: bool = False):
        """`read_only`: restore only (evaluation); nothing in `directory` is created, moved or deleted."""
        _whole_arrays_on_cpu()
        # Read-only: no retention and no save interval (Orbax would reset them, warning each time), and its
        # "directory is read only" notice, printed on every evaluation and in notebook outputs, kept quiet.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only, enable_async_checkpointing=async_save)
        paths.check_checkpointable(directory)
        with _quiet_absl_warnings(read_only):
            self.manager = ocp.CheckpointManager(paths.absolute(directory), options=options,
                                                 item_names=("state", "data"))
        # The loop asks JAX's preemption sync point at every step (train/preemption.py). Orbax asks it too, once from
        # its finalize thread with the step of a save the loop has moved past: in that window this process would
        # tell the other processes an older step, and they could agree on one it has already passed.
        self.manager.reached_preemption = lambda step: False
        self.read_only, self.abandoned = read_only, False
        self.pending_step = None  # the step of the newest save started

    def save(self, step: int, state, data_state) -> None:
        """Start saving (device → host copies happen now, the writes in the background). `data_state` is this
        process's; all processes' are gathered and saved together (process 0 writes the JSON)."""
        processes = distributed.gather_json(data_state)
        data = {"process_count": len(processes), "processes": processes}
        self.wait()  # Orbax's save waits for the previous one anyway; its failure is reported as that step's
        self.pending_step = step
        with self._storage_errors():
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            data=ocp.args.JsonSave(data)), force=True)

    def restore_or_init(self, abstract_state, init):
        """(step, state, data_state) of the newest readable checkpoint, else (0, `init()`, None)."""
        restored = self.restore_latest(abstract_state)
        if restored is None:
            return 0, init(), None
        logging.getLogger("diffjax").info("resumed from step %d in %s", restored[0], self.manager.directory)
        return restored

    def restore_latest(self, abstract_state, *, data: bool = True, step: int | None = None,
                       params_only: bool = False):
        """(step, state, data_state) of the newest readable checkpoint (a damaged one skipped with a warning; a writer
        moves it aside), or None; `abstract_state` carries the shardings to restore onto (any mesh). `data=False`: no
        data state, so no process-count check; `step`: that checkpoint, or its error; `params_only`: params alone."""
        state = ocp.args.StandardRestore(abstract_state)
        if params_only:  # a partial restore: the optimizer moments are not read
            wanted = {"params": abstract_state.params}
            state = ocp.args.PyTreeRestore(wanted, ocp.checkpoint_utils.construct_restore_args(wanted),
                                           partial_restore=True)
        args = ocp.args.Composite(state=state, **({"data": ocp.args.JsonRestore()} if data else {}))
        result = None
        for candidate in [step] if step is not None else sorted(self.manager.all_steps(), reverse=True):
            # Compared before any array is read: a restore that fails part-way leaves Orbax's reads pending, and
            # they print pages of tracebacks when the interpreter exits, burying the one-line error.
            mismatch = self._state_mismatch(candidate, abstract_state)
            if mismatch:
                raise ConfigError(f"checkpoint step {candidate} in {self.manager.directory} holds a different train "
                                  f"state than this config builds ({mismatch}); it was left as it is: run it "
                                  f"with its own config (its config.json)")
            try:
                restored = self.manager.restore(candidate, args=args)
            except Exception as e:  # noqa: BLE001 — a damaged step: its arrays agree with the state, or unreadable
                if step is not None:  # no fallback from the step asked for
                    raise
                self._skip_damaged(candidate, e)
                continue
            result = (candidate, restored.state["params"] if params_only else restored.state,
                      self._own_data_state(candidate, restored.data) if data else None)
            break
        self.manager.reload()
        return result

    def _own_data_state(self, step: int, data: dict):
        if "processes" not in data:  # written before data states were kept per process: a single-process run
            data = {"process_count": 1, "processes": [data]}
        if data["process_count"] != jax.process_count():
            raise ConfigError(f"checkpoint step {step} in {self.manager.directory} was written by "
                              f"{data['process_count']} process(es), and this run has {jax.process_count()}: each "
                              f"process saved its own shard's data position, so relaunch with "
                              f"{data['process_count']} processes (or start a new --workdir)")
        return data["processes"][jax.process_index()]

    def _state_mismatch(self, step: int, abstract_state) -> str | None:
        """How the saved state's arrays differ from `abstract_state`'s (None: they agree, or unreadable metadata,
        which is damage). Compared as multisets of (shape, dtype): container layouts differ between the two."""
        try:  # read by a handler of its own: the manager knows the state's handler only after a restore
            # (quiet: it notes that the step's own metadata file sits one level up, which is where Orbax puts it)
            with _quiet_absl_warnings(True), ocp.StandardCheckpointer() as reader:
                saved = reader.metadata(self.manager.directory / str(step) / "state")
            saved = getattr(saved, "item_metadata", saved)
        except Exception:  # noqa: BLE001 — no readable metadata: a damaged step
            return None
        arrays = lambda tree: Counter((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)  # noqa: E731
                                      if hasattr(x, "shape"))
        have, want = arrays(saved), arrays(abstract_state)
        if not have or have == want:
            return None
        only_saved, only_wanted = sorted((have - want).elements())[:3], sorted((want - have).elements())[:3]
        return (f"{sum(have.values())} arrays saved, {sum(want.values())} expected; saved only: {only_saved}; "
                f"expected only: {only_wanted}")

    def _skip_damaged(self, step: int, error: Exception) -> None:
        """Warn; a writer moves the damaged step aside (kept whole) so the resumed run can save that step anew."""
        directory = self.manager.directory
        where = "left in place (read-only restore)"
        if not self.read_only:
            target = directory.parent / "unreadable_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            where = f"moved to {target}"
            if distributed.is_main():  # every process skips the step; process 0 moves it
                paths.move_tree(directory / str(step), target)
        warnings.warn(f"checkpoint step {step} in {directory} is unreadable ({type(error).__name__}: "
                      f"{str(error)[:200]}); {where}; fell back to an earlier one", stacklevel=3)

    def wait(self) -> None:
        """Block until pending saves are written; raises if one failed (a `StorageError` if the storage refused)."""
        with self._storage_errors():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _storage_errors(self):
        try:
            yield
        except Exception as e:
            refused = _REFUSED.search(str(e))
            if isinstance(e, StorageError) or (refused is None and not isinstance(e, OSError)):
                raise
            directory = self.manager.directory
            complete = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
            last = f"step {complete[-1]}" if complete else "none yet"
            raise StorageError(f"{directory}: checkpoint step {self.pending_step} could not be written: "
                               f"{refused.group(0) if refused else e}; the last complete checkpoint: {last} (make "
                               f"room, then rerun the same command to resume from it)") from e

    def abandon(self) -> None:
        """After an error in a multi-process run, `close()` does not wait for pending saves: their completion
        barrier would wait for processes that may be gone. The last complete checkpoint stays."""
        self.abandoned = distributed.is_multi_process()

    def close(self) -> None:
        if self.abandoned:
            return
        try:
            self.wait()
        finally:
            self.manager.close()

"""Orbax checkpoints of the whole run: the train state (params, optimizer state, step, RNG, non-finite counters)
and the Grain iterator state, saved asynchronously every K steps, keeping the last N (docs/design.md §3).

Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save leaves no
step that `all_steps()` lists. A step that is listed but unreadable (a corrupt file) is moved aside with a
warning and the previous one is restored instead.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options,
                                             item_names=("state", "data"))

    def save(self, step: int, state, data_state: dict) -> None:
        """Start saving (device → host copies happen now, the writes in the background)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state)), force=True)

    def restore_latest(self, abstract_state):
        """(step, state, data_state) from the newest readable checkpoint, or None when there is none.

        `abstract_state` is a tree of `jax.ShapeDtypeStruct` carrying the shardings to restore onto, so a run
        saved on one mesh restores onto another.
        """
        result = None
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 — any failure to read means "not a good checkpoint"
                self._set_aside(step, e)
                continue
            result = step, restored.state, restored.data
            break
        self.manager.reload()
        return result

    def _set_aside(self, step: int, error: Exception) -> None:
        """Move an unreadable step out of the way (kept for inspection) so the resumed run can save it anew."""
        directory = Path(self.manager.directory)
        target = directory.parent / "unreadable_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(exist_ok=True)
        shutil.move(directory / str(step), target)
        warnings.warn(f"checkpoint step {step} in {directory} is unreadable ({type(error).__name__}: "
                      f"{str(error)[:200]}); moved it to {target} and fell back to an earlier one", stacklevel=3)

    def wait(self) -> None:
        """Block until pending saves are written; raises if one failed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

"""Running a sweep: each chunk of a group trained by the training loop (`train.loop.fit`) as stacked members, with
its state in `state/group<g>_chunk<c>/` and each member's run directory in `members/<name>/` (docs/design.md §7)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from diffjax import distributed, paths
from diffjax.config import ConfigError
from diffjax.sweep.spec import Member, Sweep
from diffjax.train import workdir_lock
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.loop import fit
from diffjax.train.members import Members

log = logging.getLogger("diffjax")
DONE = "done.json"  # written in a chunk's state directory when it has finished


@dataclasses.dataclass
class SweepResult:
    workdir: Path
    interrupted: str | None = None


def run_sweep(sweep: Sweep, workdir: str | Path, *, progress: bool = True) -> SweepResult:
    distributed.check_same(sweep.to_json(), "sweep")
    workdir = paths.run_dir(workdir)
    with workdir_lock.hold(workdir, "diffjax sweep"):
        return _run_sweep(sweep, workdir, progress=progress)


def _run_sweep(sweep: Sweep, workdir: Path, *, progress: bool) -> SweepResult:
    sweep_json = workdir / "sweep.json"
    if sweep_json.exists() and json.loads(sweep_json.read_text())["members"] != sweep.to_json()["members"]:
        raise ConfigError(f"{sweep_json} describes other members; resume it with the same sweep or use a new --workdir")
    if distributed.is_main():
        sweep_json.write_text(json.dumps(sweep.to_json(), indent=2))
    chunks = sweep.check().chunks()
    for g, c, members in chunks:
        state_dir = workdir / "state" / f"group{g}_chunk{c}"
        if (state_dir / DONE).exists():
            continue
        label = f"group {g + 1}" + (f" chunk {c + 1}" if len(chunks) > len({x[0] for x in chunks}) else "")
        result = fit(chunk_members(sweep, members, workdir, state_dir), progress=progress, label=label)
        if result.interrupted:
            return SweepResult(workdir, result.interrupted)
        if result.diverged:
            log.warning("%s: every member diverged: %s", label, result.diverged)
        _save_members(result, [workdir / "members" / m.name for m in members])
        if distributed.is_main():
            (state_dir / DONE).write_text(json.dumps({"step": result.step, "members": [m.name for m in members]}))
    return SweepResult(workdir)


def chunk_members(sweep: Sweep, members: list[Member], workdir: Path, state_dir: Path) -> Members:
    """A chunk's members as the training loop takes them: stacked (`sweep.execution`), each with its run directory."""
    return Members(tuple(m.config for m in members), tuple(workdir / "members" / m.name for m in members), state_dir,
                   execution=sweep.options.execution, devices=sweep.options.devices)


def _save_members(result, directories: list[Path]) -> None:
    """Each member's final state into its own run directory (`diffjax eval --workdir members/<name>`)."""
    checkpointers = []
    for directory, member in zip(directories, result.stack.member_states(result.state), strict=True):
        checkpointers.append(Checkpointer(directory / "checkpoints", 1))
        checkpointers[-1].save(int(member.step), member, {})  # asynchronous: the writes overlap,
        if distributed.is_multi_process():  # except across processes, where concurrent saves' barriers collide
            checkpointers.pop().close()
    for ckpt in checkpointers:
        ckpt.close()

"""The training loop: `fit` trains N ≥ 1 members (`members.py`), a run (`train`) or a sweep chunk (`sweep/runner.py`),
to `train.steps` or a stop signal, and resumes exactly from the newest checkpoint (docs/design.md §3, "The loop")."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diffjax import checks, distributed, paths
from diffjax.config import Config
from diffjax.train import faults, run_config, telemetry_plot, workdir_lock
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.members import Members, Stack
from diffjax.train.metrics import MemberWriters, MetricsLog
from diffjax.train.preemption import StopRequest
from diffjax.train.progress import ProgressBar
from diffjax.train.telemetry import Telemetry
from diffjax.train.validation import Validation

log = logging.getLogger("diffjax")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class FitResult:
    workdir: Path  # where the checkpoints are: the run directory (a sweep chunk's state directory)
    start_step: int  # the step it started (or resumed) from
    step: int  # the step it stopped at
    state: Any  # the final state, stacked (`Stack`)
    stack: Stack
    train: dict | None = None  # the last logged train record (several members': their mean)
    vals: list = dataclasses.field(default_factory=list)  # each member's last validation record
    interrupted: str | None = None  # "SIGTERM at step N; ..." when a signal stopped it
    diverged: str | None = None  # why it stopped when every member had diverged
    telemetry_pngs: list = dataclasses.field(default_factory=list)  # each member's telemetry figure (process 0)


@dataclasses.dataclass
class RunResult:
    """What `train` returns: a fit of one member, its state as its run directory keeps it."""

    workdir: Path
    start_step: int
    step: int
    state: Any  # the final TrainState
    train: dict | None = None  # the last logged train record
    val: dict | None = None  # the last validation record
    interrupted: str | None = None
    telemetry_png: Path | None = None


def train(cfg: Config, workdir: str | Path | None = None, *, progress: bool = True,
          evaluators: Sequence[Callable] = (), allow_config_change: bool = False) -> RunResult:
    """Train (or resume) the run in `workdir`. `evaluators` — objects with a `name` and `__call__(params) -> dict`
    — run beside the in-loop validation, each writing its records under its `name` in metrics.jsonl."""
    distributed.initialize()  # a no-op unless launched as several processes (and already done by the CLI)
    cfg = checks.check(cfg)
    workdir = paths.run_dir(workdir or cfg.train.workdir)
    with workdir_lock.hold(workdir, "diffjax train"):
        result = fit(Members.run(cfg, workdir), progress=progress, evaluators=evaluators,
                     allow_config_change=allow_config_change)
    if result.diverged:
        raise NonFiniteError(result.diverged)
    return RunResult(workdir, result.start_step, result.step, result.stack.member_states(result.state)[0],
                     result.train, (result.vals or [None])[0], result.interrupted,
                     (result.telemetry_pngs or [None])[0])


def fit(members: Members, *, progress: bool = True, label: str = "train", evaluators: Sequence[Callable] = (),
        allow_config_change: bool = False) -> FitResult:
    """Train (or resume) `members` to `train.steps`, to a stop signal (`FitResult.interrupted`) or until every member
    has diverged (`FitResult.diverged`)."""
    cfg, dirs = members.configs[0], members.dirs
    distributed.check_same(json.loads(cfg.to_json()), "config")  # a sweep's members: `run_sweep` checked them
    for c, d in zip(members.configs, dirs, strict=True):
        run_config.check_resume(d, c, allow_change=allow_config_change)
    restart = run_config.data_restart(dirs[0], cfg)  # only an allowed change gets here with one
    stack = Stack.build(members)
    for d in {*dirs, members.state_dir}:
        paths.makedirs(d)
    ckpt = Checkpointer(members.state_dir / "checkpoints", cfg.train.keep_checkpoints)
    with contextlib.ExitStack() as closing:
        iterators = stack.iterators()
        for it in iterators:
            closing.callback(it.close)
        start, state, data_state = stack.restore_or_init(ckpt)
        state = stack.with_optim_numbers(state)  # the saved numbers would win over an allowed change's
        if data_state is not None and restart:
            log.warning("step %d: %s", start, restart)
        elif data_state is not None:
            for it, saved in zip(iterators, data_state, strict=True):
                it.set_state(saved)
        for c, d in zip(members.configs, dirs, strict=True):  # after everything that can reject the config
            run_config.write(d, c, step=start, note=restart if data_state is not None else None)
        result = FitResult(members.state_dir, start, start, state, stack)
        writers = MemberWriters(list(dirs), enabled=distributed.is_main(), per_member=stack.member_records)
        _loop(cfg, stack, state, start, ckpt, iterators, writers, result, evaluators, progress=progress,
              label=label + stack.label)
    if distributed.is_main():
        result.telemetry_pngs = [telemetry_plot.write(d) for d in dirs]
    return result


def _loop(cfg: Config, stack: Stack, state, start: int, ckpt: Checkpointer, iterators, writers: MemberWriters,
          result: FitResult, evaluators, *, progress: bool, label: str) -> None:
    """From `start` to `train.steps`; fills `result`. Closes `ckpt` (abandoning pending saves on an error) and
    `writers`."""
    step_fn = stack.train_fn()
    validation = Validation(cfg, stack.mesh, eval_fn=stack.eval_fn())
    probe = Telemetry(cfg, stack.mesh, stack.stats_fn()) if cfg.train.telemetry_every else None

    def save(step: int, state) -> None:
        ckpt.save(step, *stack.saved(state, [it.get_state() for it in iterators]))
        writers.sync()  # on object storage: the metrics up to here, uploaded with the checkpoint

    def evaluate(step: int, state) -> str | None:
        records = zip(writers.writers, validation.records(stack.params(state)), stack.marks(state), strict=True)
        result.vals = [writer.write(step, record | mark, split=validation.name) for writer, record, mark in records]
        if evaluators:  # on each member's params, as its run directory keeps them
            for writer, member in zip(writers.writers, stack.member_states(state), strict=True):
                for evaluator in evaluators:
                    writer.write(step, evaluator(member.params), split=evaluator.name)
        losses = [r["loss"] for r in result.vals if not r["diverged"]]
        if not losses:
            return None
        return f"step {step}: val loss {np.mean(losses):.4f}" + (f" (mean of {len(losses)})" if stack.n > 1 else "")

    def telemetry(step: int, state) -> None:
        for i, record in enumerate(probe.records(stack.params(state))):
            writers.writers[i].write(step, record, split=probe.name)

    def check_finite(step: int, metrics: dict) -> None:  # each member froze in the step it diverged
        if result.diverged is None and np.all(metrics["diverged"]):
            result.diverged = (f"{int(np.max(metrics['nonfinite_run']))} consecutive steps up to step {step} had a "
                               f"non-finite loss or gradient (optim.max_nonfinite={cfg.optim.max_nonfinite})"
                               f"{' in every member' if stack.n > 1 else ''}; the last checkpoint is in "
                               f"{ckpt.manager.directory}")

    hooks = [(cfg.train.checkpoint_every, save), (cfg.train.eval_every, evaluate)]  # (every k steps, fn)
    if probe:
        hooks.append((cfg.train.telemetry_every, telemetry))
    stop, fault, index = StopRequest(), faults.planned(), start
    try:
        with stop.installed(), ProgressBar(cfg.train.steps, start, enabled=progress and distributed.is_main(),
                                           label=label) as bar:
            metrics_log = MetricsLog(writers, bar, cfg=cfg, start_step=start, n_devices=jax.device_count(),
                                     check=check_finite, models=stack.n)
            for index in range(start, cfg.train.steps):
                if stop.due(index):  # every process asks at every step (several agree on the step)
                    break
                state, metrics = step_fn(state, stack.put_batch([it.next() for it in iterators]))
                metrics_log.push(index, metrics)
                if result.diverged:  # nothing left to train
                    break
                done = index + 1  # each hook also runs after the last step
                due = [fn for every, fn in hooks if done % every == 0 or done == cfg.train.steps]
                if due:
                    jax.block_until_ready(state)  # the step's own time is not part of the pause
                    with metrics_log.pause():
                        for fn in due:
                            note = fn(done, state)
                            if note:
                                bar.note(note)
                if fault and done == fault[1]:  # tests only (train/faults.py)
                    ckpt.wait()
                    metrics_log.flush()
                    writers.sync()
                    faults.deliver(fault[0])
            else:
                index = cfg.train.steps
            if not result.diverged:
                metrics_log.flush()
            if stop.stopped and ckpt.manager.latest_step() != index:
                save(index, state)
        ckpt.wait()  # one Orbax save at a time: across processes, concurrent saves' barriers collide
        if start == cfg.train.steps:  # a finished run, resumed: report its final validation metrics
            result.vals = validation.records(stack.params(state))
    except BaseException:
        ckpt.abandon()
        with contextlib.suppress(Exception):  # the error in flight is the one to report, not what closing meets
            _close(ckpt, writers)
        raise
    _close(ckpt, writers)
    if stop.stopped:
        result.interrupted = stop.describe(index, stack.where)
    result.step, result.state, result.train = index, state, metrics_log.last


def _close(checkpointer: Checkpointer, writers: MemberWriters) -> None:
    try:
        checkpointer.close()
    finally:
        writers.close()

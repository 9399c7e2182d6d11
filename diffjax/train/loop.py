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

from diffjax import checks, distributed, sharding
from diffjax import config as config_lib
from diffjax.config import Config, MeshConfig
from diffjax.train import faults, run_config, telemetry_plot, workdir_lock
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.members import Members, Stack, diverges
from diffjax.train.metrics import MemberWriters, MetricsLog
from diffjax.train.optim import make_optimizer
from diffjax.train.preemption import StopRequest
from diffjax.train.progress import ProgressBar
from diffjax.train.state import state_shardings
from diffjax.train.telemetry import Telemetry
from diffjax.train.validation import Validation

log = logging.getLogger("diffjax")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class RunResult:
    workdir: Path  # where the checkpoints are: the run directory (a sweep chunk's state directory)
    start_step: int  # the step it started (or resumed) from
    step: int  # the step it stopped at
    state: Any  # the final state (a run's TrainState)
    stack: Stack
    train: dict | None = None  # the last logged train record (a stack's: the mean over its members)
    val: dict | None = None  # a run's last validation record
    interrupted: str | None = None  # "SIGTERM at step N; ..." when a signal stopped it
    telemetry_png: Path | None = None  # a run's telemetry figure (process 0)


def train(cfg: Config, workdir: str | Path | None = None, *, progress: bool = True,
          evaluators: Sequence[Callable] = (), allow_config_change: bool = False) -> RunResult:
    """Train (or resume) the run in `workdir`. `evaluators` — objects with a `name` and `__call__(params) -> dict`
    — run beside the in-loop validation, each writing its records under its `name` in metrics.jsonl."""
    distributed.initialize()  # a no-op unless launched as several processes (and already done by the CLI)
    cfg = checks.check(cfg)
    workdir = Path(workdir or cfg.train.workdir)
    with workdir_lock.hold(workdir, "diffjax train"):
        return fit(Members.run(cfg, workdir), progress=progress, evaluators=evaluators,
                   allow_config_change=allow_config_change)


def fit(members: Members, *, progress: bool = True, label: str = "train", evaluators: Sequence[Callable] = (),
        allow_config_change: bool = False) -> RunResult:
    """Train (or resume) `members` to `train.steps`, or to a stop signal (`RunResult.interrupted`)."""
    cfg, dirs = members.configs[0], members.dirs
    distributed.check_same(json.loads(cfg.to_json()), "config")  # a sweep's members: `run_sweep` checked them
    for c, d in zip(members.configs, dirs, strict=True):
        run_config.check_resume(d, c, allow_change=allow_config_change)
    restart = run_config.data_restart(dirs[0], cfg)  # only an allowed change gets here with one
    stack = Stack.build(members)
    if evaluators and stack.member_axis:
        raise ValueError("evaluators run on a run's params (no member axis); a sweep chunk takes none")
    for d in {*dirs, members.state_dir}:
        d.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(members.state_dir / "checkpoints", cfg.train.keep_checkpoints)
    with contextlib.ExitStack() as closing:
        iterators = stack.iterators()
        for it in iterators:
            closing.callback(it.close)
        start, state, data_state = ckpt.restore_or_init(stack.abstract, stack.init)
        state = stack.with_optim_numbers(state)  # the saved numbers would win over an allowed change's
        if data_state is not None and restart:
            log.warning("step %d: %s", start, restart)
        elif data_state is not None:
            for it, saved in zip(iterators, stack.unpack_data(data_state), strict=True):
                it.set_state(saved)
        for c, d in zip(members.configs, dirs, strict=True):  # after everything that can reject the config
            run_config.write(d, c, step=start, note=restart if data_state is not None else None)
        result = RunResult(members.state_dir, start, start, state, stack)
        writers = MemberWriters(list(dirs), enabled=distributed.is_main(), per_member=stack.member_records)
        _loop(cfg, stack, state, start, ckpt, iterators, writers, result, evaluators, progress=progress,
              label=label + stack.label)
    if distributed.is_main():
        result.telemetry_png = only([telemetry_plot.write(d) for d in dirs])
    return result


def _loop(cfg: Config, stack: Stack, state, start: int, ckpt: Checkpointer, iterators, writers: MemberWriters,
          result: RunResult, evaluators, *, progress: bool, label: str) -> None:
    """From `start` to `train.steps`; fills `result`. Closes `ckpt` (abandoning pending saves on an error) and
    `writers`."""
    step_fn = stack.train_fn()
    validation = Validation(cfg, stack.mesh, eval_fn=stack.eval_fn())
    probe = Telemetry(cfg, stack.mesh, stack.stats_fn()) if cfg.train.telemetry_every else None

    def save(step: int, state) -> None:
        ckpt.save(step, state, stack.pack_data([it.get_state() for it in iterators]))

    def evaluate(step: int, state) -> str | None:
        params = stack.params(state)
        records = [writer.write(step, record | mark, split=validation.name) for writer, record, mark
                   in zip(writers.writers, validation.records(params), stack.marks(state), strict=True)]
        result.val = only(records)
        for evaluator in evaluators:
            writers.write(step, evaluator(params), split=evaluator.name)
        return f"step {step}: val loss {result.val['loss']:.4f}" if result.val else None

    def telemetry(step: int, state) -> None:
        for i, record in enumerate(probe.records(stack.params(state))):
            writers.writers[i].write(step, record, split=probe.name)

    def check_finite(step: int, metrics: dict) -> None:  # a run stops; a stack's members froze in the step
        if stack.stops_on_divergence and diverges(metrics["nonfinite_run"], cfg):
            raise NonFiniteError(f"{int(metrics['nonfinite_run'])} consecutive steps up to step {step} had a "
                                 f"non-finite loss or gradient (optim.max_nonfinite={cfg.optim.max_nonfinite}); "
                                 f"the last checkpoint is in {ckpt.manager.directory}")

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
                    faults.deliver(fault[0])
            else:
                index = cfg.train.steps
            metrics_log.flush()
            if stop.stopped and ckpt.manager.latest_step() != index:
                save(index, state)
        ckpt.wait()  # one Orbax save at a time: across processes, concurrent saves' barriers collide
        if start == cfg.train.steps:  # a finished run, resumed: report its final validation metrics
            result.val = only(validation.records(stack.params(state)))
    except BaseException:
        ckpt.abandon()
        with contextlib.suppress(Exception):  # the error in flight is the one to report, not what closing meets
            _close(ckpt, writers)
        raise
    _close(ckpt, writers)
    if stop.stopped:
        result.interrupted = stop.describe(index, stack.where)
    result.step, result.state, result.train = index, state, metrics_log.last


def only(values: list):
    """A run's value: the one member's (a stack's are in its members' directories)."""
    return values[0] if len(values) == 1 else None


def _close(checkpointer: Checkpointer, writers: MemberWriters) -> None:
    try:
        checkpointer.close()
    finally:
        writers.close()


def load_run(workdir: str | Path, overrides=()) -> tuple[Config, object, object]:
    """(config, latest TrainState, mesh) of a run directory, restored onto this process's devices (in a multi-process
    launch each process evaluates the whole state alone: docs/design.md §3, "Multi-host")."""
    workdir = Path(workdir)
    cfg = run_config.load(workdir)
    if jax.process_count() > 1:  # the run's mesh spans processes; this one's devices hold the params (fsdp)
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=-1))
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    mesh = sharding.make_mesh(cfg.mesh, jax.local_devices())
    abstract, _ = state_shardings(cfg, mesh, make_optimizer(cfg.optim, cfg.train.steps))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints, read_only=True)
    try:
        restored = ckpt.restore_latest(abstract, data=False)
    finally:  # a refused restore too: Orbax's threads end here, not in tracebacks at exit
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{workdir / 'checkpoints'} holds no readable checkpoint")
    return cfg, restored[1], mesh

"""The training loop, built from pieces that `diffjax sweep` reuses with stacked states:

    result = train(cfg, workdir)          # a RunResult: the final state, last train / validation records, ...

- `build`: what every run builds from its config on a mesh (batch check, optimizer, abstract state, shardings);
  a sweep chunk (`sweep/runner.py`) stacks its members on top of it, and starts like a run
  (`Checkpointer.restore_or_init`) through the same `run_loop`.
- `setup_run`: a single run's parts, checkpointer, data iterator, its restored (or fresh) state and its step.
- `MetricsLog`: fetches each step's metrics one step late (dispatch stays ahead), measures tokens/s between
  logged steps with evaluation and checkpoint pauses excluded, writes records and drives the progress bar.
- `StopRequest`: SIGTERM / Ctrl-C set a flag; the loop saves a checkpoint at the next step boundary and exits.

The run directory holds `config.json` (the resolved config), `metrics.jsonl`, `tensorboard/` and
`checkpoints/`. Re-running the same command resumes from the latest complete checkpoint and continues exactly:
the checkpoint carries the train state and the data iterator's position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from diffjax import checks, distributed, sharding
from diffjax import config as config_lib
from diffjax.config import Config, ConfigError, MeshConfig
from diffjax.data.pipeline import DataIterator, make_iterator
from diffjax.flops import train_flops_per_token
from diffjax.train import faults, run_config, telemetry_plot, workdir_lock
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.metrics import MetricsWriter, peak_flops_per_device, throughput
from diffjax.train.optim import make_optimizer
from diffjax.train.state import init_state, state_shardings
from diffjax.train.step import jit_train_step
from diffjax.train.telemetry import Telemetry
from diffjax.train.validation import Validation

log = logging.getLogger("diffjax")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class RunResult:
    workdir: Path
    start_step: int  # the step the run started (or resumed) from
    step: int  # the step it stopped at
    state: Any  # the final TrainState
    train: dict | None = None  # the last logged train record
    val: dict | None = None  # the last validation record
    interrupted: str | None = None  # "SIGTERM at step N; ..." when a signal stopped it
    telemetry_png: Path | None = None  # the run's telemetry figure (process 0)


def check_batch(cfg: Config, mesh) -> None:
    b, shards, accum = cfg.data.batch_size, sharding.batch_divisor(mesh), cfg.optim.grad_accum
    if b % (shards * accum):
        raise ConfigError(f"data.batch_size: {b} must be divisible by data×fsdp devices ({shards}) × "
                          f"optim.grad_accum ({accum})")


@dataclasses.dataclass(frozen=True)
class Parts:
    mesh: jax.sharding.Mesh
    tx: Any  # the optax transformation
    abstract: Any  # TrainState of ShapeDtypeStructs
    shardings: Any  # TrainState of NamedShardings


def build(cfg: Config, mesh) -> Parts:
    """What every run builds from its config on `mesh`: the batch checked against it, the optimizer, the abstract
    train state and its shardings."""
    check_batch(cfg, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    return Parts(mesh, tx, *state_shardings(cfg, mesh, tx))


@dataclasses.dataclass
class RunSetup:
    cfg: Config
    workdir: Path
    mesh: jax.sharding.Mesh
    shardings: Any  # TrainState of NamedShardings
    checkpointer: Checkpointer
    data: DataIterator
    state: Any
    start_step: int
    train_fn: Callable  # (state, batch) -> (state, metrics), jitted and sharded


def setup_run(cfg: Config, workdir: Path, *, allow_config_change: bool = False) -> RunSetup:
    """Everything a run with a validated config needs, resumed from the latest readable checkpoint in `workdir`
    when there is one (with the run's own config, unless `allow_config_change`: see `run_config`)."""
    distributed.check_same(json.loads(cfg.to_json()), "config")
    run_config.check_resume(workdir, cfg, allow_change=allow_config_change)
    restart = run_config.data_restart(workdir, cfg)  # only an allowed change gets here with one
    workdir.mkdir(parents=True, exist_ok=True)
    parts = build(cfg, sharding.make_mesh(cfg.mesh))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints)
    index, count = sharding.process_share(parts.mesh)  # this process's slice of every global batch
    data = make_iterator(cfg.data, split="train", process_index=index, process_count=count)
    start, state, data_state = ckpt.restore_or_init(parts.abstract,
                                                    lambda: init_state(cfg, parts.tx, parts.shardings))
    restart = restart if data_state is not None else None
    if restart:
        log.warning("step %d: %s", start, restart)
    elif data_state is not None:
        data.set_state(data_state)
    run_config.write(workdir, cfg, step=start, note=restart)  # after everything that can reject the config
    return RunSetup(cfg, workdir, parts.mesh, parts.shardings, ckpt, data, state, start,
                    jit_train_step(cfg, parts.tx, parts.mesh, parts.shardings))


class MetricsLog:
    """Train metrics, fetched one step late and written every `log_every` steps (and at the last step).

    tokens/s is measured between written steps on a clock that starts after the first step (which includes
    compilation) and from which `pause()` blocks — evaluation, checkpointing — are subtracted.
    """

    def __init__(self, writer, bar, *, cfg: Config, start_step: int, n_devices: int,
                 check: Callable[[int, dict], None] = lambda step, metrics: None, models: int = 1):
        """`writer.write(step, metrics) -> record` (MetricsWriter, or a sweep's per-member writer); `models`
        counts the models one step trains (a vmapped sweep group's members) for tokens/s."""
        self.writer, self.bar, self.check = writer, bar, check
        self.log_every, self.total = cfg.train.log_every, cfg.train.steps
        self.tokens_per_step = models * cfg.data.batch_size * cfg.data.seq_len
        self.flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
        self.n_devices, self.peak = n_devices, peak_flops_per_device()
        self.clock = {"time": None, "step": start_step, "paused": 0.0}
        self.pending, self.last = None, None

    def push(self, step: int, metrics) -> None:
        """Queue step `step`'s (device) metrics and handle the previous step's."""
        if self.pending is not None:
            self._record(*self.pending)
        self.pending = (step, metrics)

    def flush(self) -> None:
        if self.pending is not None:
            self._record(*self.pending)
            self.pending = None

    @contextlib.contextmanager
    def pause(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.clock["paused"] += time.perf_counter() - start

    def _record(self, step: int, metrics) -> None:
        metrics = jax.device_get(metrics)
        self.check(step, metrics)
        now, clock = time.perf_counter(), self.clock
        if clock["time"] is None:  # the first step includes compilation: start the clock after it
            clock.update(time=now, step=step, paused=0.0)
            return
        if (step + 1) % self.log_every and step + 1 != self.total:
            return
        seconds = now - clock["time"] - clock["paused"]
        metrics |= throughput(self.tokens_per_step * (step - clock["step"]), seconds, self.flops_per_token,
                              self.n_devices, self.peak)
        clock.update(time=now, step=step, paused=0.0)
        self.last = self.writer.write(step + 1, metrics)
        self.bar.update(step + 1, self.last)


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.signal = None

    @contextlib.contextmanager
    def installed(self):
        def handler(signum, _frame):
            self.signal = signal.Signals(signum).name
            signal.signal(signum, previous[signum])  # a second signal acts at once

        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
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


@dataclasses.dataclass
class LoopOutcome:
    state: Any
    step: int  # the step it stopped at
    train: dict | None  # the last logged train record (a sweep's: the summary over its members)
    stopped_by: str | None  # the signal that stopped it early ("SIGTERM"), else None


def run_loop(cfg: Config, state, start: int, *, step: Callable, save: Callable, evaluate: Callable, writer,
             checkpointer: Checkpointer, check: Callable[[int, dict], None] = lambda step, metrics: None,
             telemetry: Callable[[int, Any], None] | None = None, progress: bool = True, label: str = "train",
             models: int = 1) -> LoopOutcome:
    """The training loop of every run — a single model (`train`) or a sweep chunk's stacked members
    (`diffjax.sweep.runner`): from `start` to `train.steps`, `state, metrics = step(state)` (which reads its own
    batch), `save(step, state)` every `train.checkpoint_every` steps, `evaluate(step, state) -> note | None`
    every `train.eval_every` and `telemetry(step, state)` every `train.telemetry_every` (all also after the last
    step), metrics through a `MetricsLog` (with `check` on each step's), and a checkpoint at the step boundary
    where SIGTERM / Ctrl-C stop it.

    Closes `checkpointer` (abandoning pending saves on an error) and `writer`."""
    stop, fault = StopRequest(), faults.planned()
    hooks = [(cfg.train.checkpoint_every, save), (cfg.train.eval_every, evaluate)]  # (every k steps, fn)
    if telemetry and cfg.train.telemetry_every:
        hooks.append((cfg.train.telemetry_every, telemetry))
    index = start
    try:
        with stop.installed(), ProgressBar(cfg.train.steps, start, enabled=progress and distributed.is_main(),
                                           label=label) as bar:
            metrics_log = MetricsLog(writer, bar, cfg=cfg, start_step=start, n_devices=jax.device_count(),
                                     check=check, models=models)
            for index in range(start, cfg.train.steps):
                if stop.signal:
                    break
                state, metrics = step(state)
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
                    checkpointer.wait()
                    metrics_log.flush()
                    faults.deliver(fault[0])
            else:
                index = cfg.train.steps
            metrics_log.flush()
            if stop.signal and checkpointer.manager.latest_step() != index:
                save(index, state)
        checkpointer.wait()  # one Orbax save at a time: across processes, concurrent saves' barriers collide
    except BaseException:
        checkpointer.abandon()
        with contextlib.suppress(Exception):  # the error in flight is the one to report, not what closing meets
            _close(checkpointer, writer)
        raise
    _close(checkpointer, writer)
    return LoopOutcome(state, index, metrics_log.last, stop.signal)


def _close(checkpointer: Checkpointer, writer) -> None:
    try:
        checkpointer.close()
    finally:
        writer.close()


def train(cfg: Config, workdir: str | Path | None = None, *, progress: bool = True,
          evaluators: Sequence[Callable] | None = None, allow_config_change: bool = False) -> RunResult:
    """Train (or resume) the run in `workdir`.

    In-loop validation (split "val") and any further `evaluators` — objects with a `name` and
    `__call__(params) -> dict` — run every `train.eval_every` steps and at the end, each writing its records under
    its `name` in metrics.jsonl.
    """
    distributed.initialize()  # a no-op unless launched as several processes (and already done by the CLI)
    cfg = checks.check(cfg)
    workdir = Path(workdir or cfg.train.workdir)
    with workdir_lock.hold(workdir, "diffjax train"):
        return _train(cfg, workdir, evaluators or (), progress=progress, allow_config_change=allow_config_change)


def _train(cfg: Config, workdir: Path, evaluators, *, progress: bool, allow_config_change: bool) -> RunResult:
    run = setup_run(cfg, workdir, allow_config_change=allow_config_change)
    cfg, ckpt, data = run.cfg, run.checkpointer, run.data
    evaluators = [Validation(cfg, run.mesh, run.shardings.params), *evaluators]
    writer = MetricsWriter(run.workdir, enabled=distributed.is_main())
    result = RunResult(run.workdir, run.start_step, run.start_step, run.state)

    def check_finite(step: int, metrics: dict) -> None:
        if int(metrics["nonfinite_run"]) >= cfg.optim.max_nonfinite:
            raise NonFiniteError(f"{int(metrics['nonfinite_run'])} consecutive steps up to step {step} had a "
                                 f"non-finite loss or gradient (optim.max_nonfinite={cfg.optim.max_nonfinite}); "
                                 f"the last checkpoint is in {ckpt.manager.directory}")

    def evaluate(step: int, state) -> str | None:
        for evaluator in evaluators:
            record = writer.write(step, evaluator(state.params), split=evaluator.name)
            if evaluator.name == "val":
                result.val = record
        return f"step {step}: val loss {result.val['loss']:.4f}" if result.val else None

    telemetry = None
    if cfg.train.telemetry_every:
        probe = Telemetry(cfg, run.mesh, run.shardings.params)

        def telemetry(step: int, state) -> None:
            writer.write(step, probe(state.params), split=probe.name)

    with contextlib.closing(data):
        outcome = run_loop(cfg, run.state, run.start_step, writer=writer, checkpointer=ckpt, check=check_finite,
                           progress=progress, evaluate=evaluate, telemetry=telemetry,
                           step=lambda state: run.train_fn(state, sharding.put_batch(data.next(), run.mesh)),
                           save=lambda step, state: ckpt.save(step, state, data.get_state()))
    if run.start_step == cfg.train.steps:  # a finished run, resumed: report its final validation metrics
        result.val = next((e(outcome.state.params) for e in evaluators if e.name == "val"), None)
    if outcome.stopped_by:
        result.interrupted = f"{outcome.stopped_by} at step {outcome.step}; checkpoint saved, rerun to resume"
    result.step, result.state, result.train = outcome.step, outcome.state, outcome.train
    if distributed.is_main():
        result.telemetry_png = telemetry_plot.write(run.workdir)
    return result


class ProgressBar:
    """Progress with the latest loss: a rich bar on a terminal; where output goes to a log (nohup, SLURM), one
    plain line every `every` seconds and at the end. Silent when disabled (tests, non-main processes)."""

    def __init__(self, total: int, start: int, enabled: bool, label: str = "train", every: float = 30.0):
        self.enabled, self.total, self.start, self.label = enabled, total, start, label
        self.every, self.terminal = every, sys.stdout.isatty()

    @staticmethod
    def bar(label: str, console=None):
        """The terminal bar: label, bar, steps done / total, ETA, latest loss and tokens/s — one line that fits 80
        columns with a label of up to ~20 characters (a sweep's "group 1 (3× serial)")."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # a long speed window: logged steps can be minutes apart on a CPU, and the ETA needs two of them
        return Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=12), MofNCompleteColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), speed_estimate_period=3600,
                        console=console)

    @staticmethod
    def info(metrics: dict) -> str:
        return f"loss {metrics['loss']:.4f} {metrics['tokens_per_s']:,.0f} tok/s"

    def __enter__(self):
        if self.enabled and self.terminal:
            self.progress = self.bar(self.label)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=self.total, completed=self.start, info="")
        self.clock = (time.monotonic(), self.start)
        self.printed = -math.inf
        return self

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        info = self.info(metrics)
        if self.terminal:
            self.progress.update(self.task, completed=step, info=info)
            return
        now = time.monotonic()
        if now - self.printed >= self.every or step == self.total:
            self.printed = now
            started, first = self.clock
            rate = (step - first) / max(now - started, 1e-9)
            eta = datetime.timedelta(seconds=round((self.total - step) / rate)) if rate > 0 else "?"
            print(f"{self.label}: step {step}/{self.total} ({step / self.total:.0%})  {info}  lr {metrics['lr']:.1e}  "
                  f"eta {eta}", flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            if self.terminal:
                self.progress.console.log(text)
            else:
                print(f"{self.label}: {text}", flush=True)

    def __exit__(self, *exc):
        if self.enabled and self.terminal:
            self.progress.stop()
        return False


def load_run(workdir: str | Path, overrides=()) -> tuple[Config, object, object]:
    """(config, latest TrainState, mesh) of a run directory, restored onto this process's devices.

    In a multi-process launch every process restores the whole state onto its own devices (fsdp over them, unless
    `overrides` say otherwise) and evaluates it alone (evaluation is replicated; process 0 writes the
    results), so protocols need no collectives.
    """
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

"""The training loop: resume, step, log a step late, evaluate, checkpoint, stop cleanly on SIGTERM / Ctrl-C.

    summary = train(cfg, workdir)

The run directory holds `config.json` (the resolved config), `metrics.jsonl`, `tensorboard/` and
`checkpoints/`. Re-running the same command resumes from the latest complete checkpoint and continues exactly:
the checkpoint carries the train state and the data iterator's position.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from pathlib import Path

import jax

from diffjax import config as config_lib
from diffjax import sharding
from diffjax.config import Config, ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.flops import train_flops_per_token
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.metrics import MetricsWriter, peak_flops_per_device, throughput
from diffjax.train.optim import make_optimizer
from diffjax.train.state import init_state, state_shardings
from diffjax.train.step import jit_eval_step, jit_train_step

log = logging.getLogger("diffjax")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def write_config(workdir: Path, cfg: Config) -> None:
    """Write config.json; on resume, refuse a config whose model or data differ from the run's."""
    path = workdir / "config.json"
    if path.exists():
        old = config_lib.from_dict(json.loads(path.read_text()))
        for section in ("model", "data"):
            if getattr(old, section) != getattr(cfg, section):
                raise ConfigError(f"{path} was written with a different {section} config; resuming it with this one "
                                  f"would not continue the same run (use a new --workdir)")
    if jax.process_index() == 0:
        path.write_text(cfg.to_json())


def _check_batch(cfg: Config, mesh) -> None:
    b, shards, accum = cfg.data.batch_size, sharding.batch_divisor(mesh), cfg.optim.grad_accum
    if b % (shards * accum):
        raise ConfigError(f"data.batch_size: {b} must be divisible by data×fsdp devices ({shards}) × "
                          f"optim.grad_accum ({accum})")


class _StopRequest:
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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged loss would overflow


def evaluate(eval_fn, params, cfg: Config, mesh) -> dict:
    """Mean loss, perplexity and accuracies over `train.eval_batches` batches of a fresh validation iterator."""
    data = make_iterator(cfg.data, split="val")
    totals = None
    for _ in range(cfg.train.eval_batches):
        out = jax.device_get(eval_fn(params, sharding.put_batch(next(data), mesh)))
        totals = out if totals is None else {k: totals[k] + out[k] for k in out}
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / tokens
    return {"loss": loss, "perplexity": perplexity(loss), "token_accuracy": float(totals["correct"]) / tokens,
            "exact_match": float(totals["exact_rows"]) / max(float(totals["rows"]), 1.0)}


def train(cfg: Config, workdir: str | Path | None = None, *, progress: bool = True) -> dict:
    """Train (or resume) the run in `workdir`; returns a summary with the last train and validation metrics."""
    sharding.maybe_initialize_distributed()
    cfg = cfg.validate()
    workdir = Path(workdir or cfg.train.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = sharding.make_mesh(cfg.mesh)
    _check_batch(cfg, mesh)

    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract, shardings = state_shardings(cfg, mesh, tx)
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints)
    data = make_iterator(cfg.data, split="train", process_index=jax.process_index(),
                         process_count=jax.process_count())
    write_config(workdir, cfg)  # after everything that can reject the config
    restored = ckpt.restore_latest(abstract)
    if restored:
        start, state, data_state = restored
        data.set_state(data_state)
        log.info("resumed from step %d in %s", start, workdir)
    else:
        start, state = 0, init_state(cfg, tx, shardings)
    train_fn = jit_train_step(cfg, tx, mesh, shardings)
    eval_fn = jit_eval_step(cfg, mesh, shardings.params)

    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops_per_device()
    summary = {"workdir": str(workdir), "start_step": start}
    # throughput clock: evaluation and checkpoint pauses are subtracted, so tokens/s measures training
    last_logged = {"time": None, "step": start, "paused": 0.0}

    def record(step: int, metrics: dict) -> None:
        """Handle step `step`'s metrics (fetched one step late so dispatch stays ahead)."""
        metrics = jax.device_get(metrics)
        if int(metrics["nonfinite_run"]) >= cfg.optim.max_nonfinite:
            raise NonFiniteError(f"{int(metrics['nonfinite_run'])} consecutive steps up to step {step} had a "
                                 f"non-finite loss or gradient (optim.max_nonfinite={cfg.optim.max_nonfinite}); "
                                 f"the last checkpoint is in {ckpt.manager.directory}")
        now = time.perf_counter()
        if last_logged["time"] is None:  # the first step includes compilation: start the clock after it
            last_logged.update(time=now, step=step, paused=0.0)
            return
        if (step + 1) % cfg.train.log_every and step + 1 != cfg.train.steps:
            return
        seconds = now - last_logged["time"] - last_logged["paused"]
        metrics["perplexity"] = perplexity(float(metrics["loss"]))
        metrics |= throughput(tokens_per_step * (step - last_logged["step"]), seconds, flops_per_token,
                              jax.device_count(), peak)
        last_logged.update(time=now, step=step, paused=0.0)
        summary["train"] = writer.write(step + 1, metrics)
        bar.update(step + 1, metrics)

    stop = _StopRequest()
    pending, step = None, start
    try:
        with stop.installed(), _ProgressBar(cfg.train.steps, start, enabled=progress and is_main) as bar:
            for step in range(start, cfg.train.steps):
                if stop.signal:
                    break
                state, metrics = train_fn(state, sharding.put_batch(data.next(), mesh))
                if pending is not None:
                    record(*pending)
                pending = (step, metrics)
                last = step + 1 == cfg.train.steps
                save = (step + 1) % cfg.train.checkpoint_every == 0 or last
                run_eval = (step + 1) % cfg.train.eval_every == 0 or last
                if save or run_eval:
                    jax.block_until_ready(state)  # the step's own time is not part of the pause
                    pause_start = time.perf_counter()
                    if save:
                        ckpt.save(step + 1, state, data.get_state())
                    if run_eval:
                        summary["val"] = writer.write(step + 1, evaluate(eval_fn, state.params, cfg, mesh),
                                                      split="val")
                        bar.note(f"step {step + 1}: val loss {summary['val']['loss']:.4f}")
                    last_logged["paused"] += time.perf_counter() - pause_start
            else:
                step = cfg.train.steps
            if start == cfg.train.steps:  # a finished run, resumed: report its final validation metrics
                summary["val"] = evaluate(eval_fn, state.params, cfg, mesh)
            if pending is not None:
                record(*pending)
            if stop.signal:
                if ckpt.manager.latest_step() != step:
                    ckpt.save(step, state, data.get_state())
                summary["interrupted"] = f"{stop.signal} at step {step}; checkpoint saved, rerun to resume"
    finally:
        ckpt.close()
        writer.close()
        data.close()
    summary.update(step=step, state=state)
    return summary


class _ProgressBar:
    """A rich progress bar with the latest loss; silent when disabled (tests, non-main processes)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled, self.total, self.start = enabled, total, start

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, metrics: dict) -> None:
        if self.enabled:
            info = f"loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  {metrics['tokens_per_s']:,.0f} tok/s"
            self.progress.update(self.task, completed=step, info=info)

    def note(self, text: str) -> None:
        if self.enabled:
            self.progress.console.log(text)

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()
        return False


def load_run(workdir: str | Path, mesh_overrides=()) -> tuple[Config, object, object]:
    """(config, latest TrainState, mesh) of a run directory, restored onto this machine's devices."""
    workdir = Path(workdir)
    path = workdir / "config.json"
    if not path.exists():
        raise ConfigError(f"{workdir} is not a run directory: it has no config.json")
    cfg = config_lib.from_dict(json.loads(path.read_text()))
    for assignment in mesh_overrides:
        cfg = config_lib.override(cfg, assignment)
    mesh = sharding.make_mesh(cfg.mesh)
    abstract, _ = state_shardings(cfg, mesh, make_optimizer(cfg.optim, cfg.train.steps))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints)
    restored = ckpt.restore_latest(abstract)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{workdir / 'checkpoints'} holds no readable checkpoint")
    return cfg, restored[1], mesh

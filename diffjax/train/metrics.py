"""Run metrics: `metrics.jsonl`, TensorBoard (tensorboardX), throughput and MFU: training FLOPs per token × tokens/s
/ the devices' peak dense bf16 FLOP/s, not reported where the peak is unknown (a CPU) (docs/design.md §3)."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from diffjax import paths
from diffjax.config import Config
from diffjax.flops import train_flops_per_token

# Dense bf16 peak FLOP/s per device (no sparsity); the first name in the device kind wins. Sources: NVIDIA's
# datasheets (H100's 1,979 / 1,513 TFLOPS "with sparsity" halved; H200 has H100 SXM's tensor cores), Google Cloud
# TPU documentation (bf16 per chip). JAX names v5e and v6e "TPU v5 lite" and "TPU v6 lite".
PEAK_FLOPS = {
    "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}


def peak_flops_per_device(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind.lower()
    return next((flops for name, flops in PEAK_FLOPS.items() if name.lower() in kind), None)


def throughput(tokens: int, seconds: float, flops_per_token: float, n_devices: int, peak: float | None) -> dict:
    tokens_per_s = tokens / seconds
    out = {"tokens_per_s": tokens_per_s, "tflops_per_s": flops_per_token * tokens_per_s / 1e12}
    if peak:
        out["mfu"] = flops_per_token * tokens_per_s / (peak * n_devices)
    return out


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged loss would overflow


def _plain(value):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: where torch is installed tensorboardX imports it (1.6 s
    and ~200 MB per process) only to accept torch tensors, and we log floats."""
    block = "torch" not in sys.modules  # a process that already has torch keeps it
    if block:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends to `metrics.jsonl` and TensorBoard events in the run directory (process 0 only). A run on object
    storage, where nothing can be appended to, writes both in a local staging directory and uploads each file whole
    at `sync()` (each checkpoint) and `close()`: a hard kill loses the records since the last checkpoint, which the
    resumed run logs again."""

    def __init__(self, workdir: Path, enabled: bool = True):
        self.enabled, self.workdir, self.staging = enabled, paths.run_dir(workdir), None
        if not enabled:
            return
        local = self.workdir
        if paths.is_remote(self.workdir):
            self.staging = local = Path(tempfile.mkdtemp(prefix="diffjax-metrics-"))
            remote = self.workdir / "metrics.jsonl"
            paths.refresh(remote)
            if remote.exists():  # appended to as a local run appends
                (local / "metrics.jsonl").write_bytes(remote.read_bytes())
        SummaryWriter = _summary_writer_class()
        self.jsonl = open(local / "metrics.jsonl", "a")  # noqa: SIM115 — kept open for the run
        self.tb = SummaryWriter(str(local / "tensorboard"))
        self.uploaded = {}  # staged file -> its size when last uploaded

    def write(self, step: int, metrics: dict, split: str = "train") -> dict:
        record = {"step": step, "split": split, **{k: _plain(v) for k, v in metrics.items()}}
        if "loss" in record and "perplexity" not in record:
            record["perplexity"] = perplexity(record["loss"])
        if not self.enabled:
            return record
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in _scalars(record):
            self.tb.add_scalar(f"{split}/{key}", value, step)
        return record

    def sync(self) -> None:
        """Upload what changed since the last sync (a run on object storage; nothing otherwise)."""
        if not self.enabled or self.staging is None:
            return
        self.tb.flush()
        for file in sorted(p for p in self.staging.rglob("*") if p.is_file()):
            size = file.stat().st_size
            if self.uploaded.get(file) != size:
                (self.workdir / file.relative_to(self.staging).as_posix()).write_bytes(file.read_bytes())
                self.uploaded[file] = size

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()
            if self.staging is not None:
                self.sync()
                shutil.rmtree(self.staging, ignore_errors=True)


class MetricsLog:
    """Train metrics, fetched one step late and written every `log_every` steps and at the last; tokens/s excludes
    the first (compiling) step and `pause()` blocks (evaluation, checkpointing)."""

    def __init__(self, writer, bar, *, cfg: Config, start_step: int, n_devices: int,
                 check: Callable[[int, dict], None] = lambda step, metrics: None, models: int = 1):
        """`writer`: a `MemberWriters`; `models`: the models one step trains (a sweep chunk's members), for tokens/s."""
        self.writer, self.bar, self.check = writer, bar, check
        self.log_every, self.total = cfg.train.log_every, cfg.train.steps
        self.tokens_per_step = models * cfg.data.batch_size * cfg.data.seq_len
        self.flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
        self.n_devices, self.peak = n_devices, peak_flops_per_device()
        self.clock = {"time": None, "step": start_step, "paused": 0.0}
        self.pending, self.last = None, None

    def push(self, step: int, metrics) -> None:
        """Queue step `step`'s (device) metrics and handle the previous step's."""
        self.flush()
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


class MemberWriters:
    """One `MetricsWriter` per member's run directory. `write` splits metrics into one record per member (`per_member`,
    the stack's); it returns the record of a run (one member), or the members' loss and lr averaged over those not
    diverged."""

    def __init__(self, directories: list[Path], enabled: bool, per_member: Callable[[dict], list[dict]]):
        self.writers, self.per_member = [MetricsWriter(d, enabled=enabled) for d in directories], per_member

    def write(self, step: int, metrics: dict, split: str = "train") -> dict:
        records = [w.write(step, m, split) for w, m in zip(self.writers, self.per_member(metrics), strict=True)]
        if len(records) == 1:
            return records[0]
        ok = [r for r in records if not r["diverged"]]
        summary = {k: float(np.mean([r[k] for r in ok])) if ok else float("nan") for k in ("loss", "lr")}
        return summary | {"tokens_per_s": records[0]["tokens_per_s"]}

    def sync(self) -> None:
        for w in self.writers:
            w.sync()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _scalars(record: dict, prefix: str = ""):
    """(name, number) pairs of a record for TensorBoard: lists become `name/layer_i` (per-layer values such as λ),
    nested dicts `name/key`; strings, None and the step / split keys are skipped."""
    for key, value in record.items():
        if not prefix and key in ("step", "split"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _scalars(value, f"{name}/")
        elif isinstance(value, list):
            yield from ((f"{name}/layer_{i}", v) for i, v in enumerate(value) if isinstance(v, int | float))
        elif isinstance(value, int | float):  # bool included, as 0 / 1
            yield name, int(value) if isinstance(value, bool) else value


def read_metrics(workdir: str | Path) -> list[dict]:
    path = paths.run_dir(workdir) / "metrics.jsonl"
    paths.refresh(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

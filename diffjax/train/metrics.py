"""Run metrics: `metrics.jsonl` (one object per logged step), TensorBoard (tensorboardX), throughput and MFU.

MFU = (training FLOPs per token, docs/design.md §4) × tokens/s / (peak dense bf16 FLOP/s of the devices). The peak is
known for common accelerators; elsewhere (a CPU) MFU is not reported rather than guessed, and `tflops_per_s`
(achieved, algorithmic) is logged instead.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

# Dense bf16 peak FLOP/s per device (no sparsity); the first name in the device kind wins. Sources: NVIDIA's
# datasheets — H100 SXM 989 and H100 PCIe 756 (the H100 Tensor Core GPU datasheet lists 1,979 / 1,513 TFLOPS "with
# sparsity", halved here), H200 989 (H200 datasheet, same tensor cores as H100 SXM), A100 312 (A100 datasheet), L4 121,
# A10 125; Google Cloud TPU documentation (system architecture pages, bf16 per chip) — v4 275, v5e 197, v5p 459,
# v6e (Trillium) 918. JAX names v5e and v6e "TPU v5 lite" and "TPU v6 lite".
PEAK_FLOPS = {
    "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}


def peak_flops_per_device(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


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
    """Appends to `metrics.jsonl` and TensorBoard events in the run directory (process 0 only)."""

    def __init__(self, workdir: Path, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        SummaryWriter = _summary_writer_class()
        self.jsonl = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 — kept open for the run
        self.tb = SummaryWriter(str(workdir / "tensorboard"))

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

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


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
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield name, value
        elif isinstance(value, bool):
            yield name, int(value)


def read_metrics(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

"""What the benchmarks share: where they ran (CPU model, library versions, recorded beside every figure) and timing
side by side: each round runs every call once, back to back (alternating the order), so drift in the machine's load
or clocks hits all alike; two calls compare by the median of their per-round ratios."""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

MIN_ROUNDS = 3  # rounds kept however little time is left: fewer say nothing about the spread


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(*modules: str) -> dict:
    """{"python": ..., module: module.__version__ for each named module}."""
    return {"python": platform.python_version()} | {m: importlib.import_module(m).__version__ for m in modules}


def emit(result: dict, json_path: str | Path | None,
         libraries: tuple[str, ...] = ("jax", "jaxlib", "flax", "optax", "numpy")) -> int:
    """Print `result` with the device and the libraries' versions as JSON, also to `json_path` if given; 0."""
    result = result | {"device": cpu_model(), "versions": versions(*libraries)}
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
    return 0


def time_interleaved(calls, warmup: int, reps: int, deadline: float = float("inf")) -> list[list[float]]:
    """Seconds of each `(fn, args)` in `calls` per round: `warmup` untimed rounds, then up to `reps` (fewer once
    `time.monotonic()` passes `deadline`, never under MIN_ROUNDS), each call bracketed by `jax.block_until_ready`."""
    import jax  # here: the scripts that only record versions import diffjax (its quiet jax import) first

    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for r in range(reps):
        if r >= MIN_ROUNDS and time.monotonic() >= deadline:
            break
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            fn, args = calls[i]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return times


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def per_round_ratio(a: list[float], b: list[float]) -> dict:
    """The median (p10, p90) of the per-round ratios a[i] / b[i] of two interleaved timings."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return dict(median=statistics.median(ratios), p10=percentile(ratios, 10), p90=percentile(ratios, 90))

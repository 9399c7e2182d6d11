"""Timing side by side: each round runs every call once, back to back (alternating the order), so drift in the
machine's load or clocks hits all alike; two calls compare by the median of their per-round ratios."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from diffjax.bench.budget import Deadline

MIN_ROUNDS = 3  # rounds kept however little time is left: fewer say nothing about the spread


def time_interleaved(calls, warmup: int, reps: int, deadline: Deadline | None = None) -> list[list[float]]:
    """Seconds of each `(fn, args)` in `calls` per round: `warmup` untimed rounds, then up to `reps` (fewer once
    `deadline` has passed, never under MIN_ROUNDS), each call bracketed by `jax.block_until_ready`."""
    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for r in range(reps):
        if deadline is not None and r >= MIN_ROUNDS and not deadline.allows():
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

"""Statistics over seeds for every report (the main job, sweeps, the studies): mean ± std per arm, and paired
comparisons. Members that share a seed share data order and every common initial parameter (docs/sweeps.md), so
the per-seed difference removes each seed's own luck: its spread is what a comparison must beat."""

from __future__ import annotations

import csv
import dataclasses
import io
import math

import numpy as np

from diffjax import paths

LEVEL = 0.95  # the confidence interval's level; a difference is "detected" when p < 1 − LEVEL
MIN_SEEDS = 3  # fewer pairs are too few to judge: at n = 2 a difference has the same sign in both seeds half the time


def precision(digits: int) -> float:
    """One unit of the last printed digit: the smallest difference a table printed with `digits` decimals shows."""
    return 10.0**-digits


@dataclasses.dataclass(frozen=True)
class Paired:
    n: int  # seeds present (and finite) in both
    mean: float  # mean of the per-seed differences a − b
    ci: tuple[float, float]  # 95 % bootstrap interval of that mean (percentile method)
    p: float  # two-sided paired t-test
    diffs: tuple[float, ...] = ()  # the per-seed differences a − b, in seed order

    @property
    def detected(self) -> bool:
        return self.p < 1 - LEVEL

    def verdict(self, a: str, resolution: float) -> str:
        """The plain reading, the one every report prints: under MIN_SEEDS seeds "too few seeds to judge at n = 2";
        a mean under `resolution` (the printed precision, or a minimum effect the report names) "no measurable
        difference at resolution 0.0001", whatever p; p ≥ 0.05 "no detectable difference at n = 3"; else "a is
        higher" / "a is lower"."""
        if self.n < MIN_SEEDS:
            return f"too few seeds to judge at n = {self.n}"
        if abs(self.mean) < resolution:
            return f"no measurable difference at resolution {resolution:g}"
        if not self.detected:
            return f"no detectable difference at n = {self.n}"
        return f"{a} is {'higher' if self.mean > 0 else 'lower'}"

    def per_seed(self, digits: int = 4) -> str:
        return ", ".join(f"{d:+.{digits}f}" for d in self.diffs)

    def brief(self, digits: int = 3) -> str:
        """One table cell: "mean [CI low, CI high] p=…" ("—" under two seeds)."""
        if self.n < 2:
            return "—"
        return f"{self.mean:+.{digits}f} [{self.ci[0]:+.{digits}f}, {self.ci[1]:+.{digits}f}] p={self.p:.2g}"

    def cells(self, a: str, digits: int = 4, resolution: float | None = None) -> str:
        """A table row's cells: "n | per seed | mean difference | 95% CI | p | reading" (`a`: the variant's name;
        CI and p "—" under two seeds; `resolution`: a minimum effect, default the printed precision)."""
        ci, p = (f"{self.ci[0]:+.{digits}f} to {self.ci[1]:+.{digits}f}", f"{self.p:.3g}") if self.n > 1 else ("—", "—")
        reading = self.verdict(a, precision(digits) if resolution is None else resolution)
        return f"{self.n} | {self.per_seed(digits)} | {self.mean:+.{digits}f} | {ci} | {p} | {reading}"

    def sentence(self, a: str, b: str, metric: str = "validation loss", resolution: float | None = None) -> str:
        """The reading under a table, its numbers printed to 4 decimals (`resolution` as in `cells`)."""
        reading = self.verdict(a, precision(4) if resolution is None else resolution)
        if self.n < 2:
            return f"{a} − {b}: {reading}"
        stats = (f"{self.mean:+.4f} (per seed {self.per_seed()}; 95% CI {self.ci[0]:+.4f} to {self.ci[1]:+.4f}, "
                 f"paired t-test p = {self.p:.3g}, n = {self.n})")
        return f"{a} − {b} in {metric}: {stats}: {reading}"


def write_csv(path, rows: list[dict]) -> None:
    """`rows`, dicts with the same keys, as a CSV file with a header line."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    paths.run_dir(path).write_bytes(text.getvalue().encode())  # a sweep directory may be on object storage


def mean_std(values, digits: int = 3) -> str:
    """"mean ± std" (sample std) of the finite values; the value alone for one, "—" for none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "—"
    spread = f" ± {np.std(values, ddof=1):.{digits}f}" if len(values) > 1 else ""
    return f"{np.mean(values):.{digits}f}{spread}"


def paired(a: dict[int, float], b: dict[int, float], *, resamples: int = 10_000, seed: int = 0) -> Paired:
    """Variant `a` minus reference `b`, over the seeds both have with finite values."""
    from scipy import stats

    seeds = sorted(s for s in set(a) & set(b) if math.isfinite(a[s]) and math.isfinite(b[s]))
    d = np.array([a[s] - b[s] for s in seeds], np.float64)
    n = len(d)
    if n < 2:
        return Paired(n, float(d.mean()) if n else math.nan, (math.nan, math.nan), math.nan, tuple(d.tolist()))
    sd = d.std(ddof=1)
    if sd == 0:  # every seed moved by the same amount: the test is degenerate, the difference is not
        p = 1.0 if d[0] == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(d.mean()) / (sd / math.sqrt(n)), n - 1))
    means = np.random.default_rng(seed).choice(d, (resamples, n)).mean(1)
    tail = 100 * (1 - LEVEL) / 2
    ci = (float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail)))
    return Paired(n, float(d.mean()), ci, p, tuple(d.tolist()))

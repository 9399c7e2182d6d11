"""Fig. 3 of the paper from scaling sweeps: power-law fits per arch and "DIFF matches the Transformer at x % of the
parameters / tokens", with a bootstrap over seeds (docs/sweeps.md, "Scaling report").

    report(size_sweep=run_sweep("size", "corpus.txt"), token_sweep=run_sweep("tokens", "corpus.txt"))
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit

from diffjax import config as config_lib
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError
from diffjax.model import param_count
from diffjax.stats import mean_std, paired, precision
from diffjax.train.metrics import read_metrics

REFERENCE = "transformer"  # every other arch's matching fraction is taken against it
COLORS = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink")


def power_law(x, e, a, alpha):
    return e + a * np.power(x, -alpha)


def fit_power_law(x, y) -> tuple[float, float, float] | None:
    """(E, A, α) of y = E + A·x^−α by least squares in log-x, or None when it does not converge."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    scale = float(np.exp(np.mean(np.log(x))))  # fit on x / scale so A stays O(1)
    p0 = (max(0.0, y.min() - 0.5 * (y.max() - y.min())), y.max() - y.min() + 1e-3, 0.5)
    try:
        (e, a, alpha), _ = curve_fit(power_law, x / scale, y, p0=p0, bounds=([0, 0, 1e-3], [np.inf, np.inf, 5]),
                                     maxfev=20000)
    except (RuntimeError, ValueError):
        return None
    return float(e), float(a * scale**alpha), float(alpha)


def matching_fraction(diff_fit, transformer_fit, x_ref: float) -> float:
    """x_D / x_ref where the DIFF fit reaches the Transformer fit's loss at x_ref (nan if it never does)."""
    target = power_law(x_ref, *transformer_fit)
    e, a, alpha = diff_fit
    if target <= e:
        return math.nan
    return float(((target - e) / a) ** (-1.0 / alpha) / x_ref)


def _runs(sweep_dir: Path):
    """(sweep.json entry, config, validation records) of every member that has not diverged."""
    for m in json.loads((sweep_dir / "sweep.json").read_text())["members"]:
        run = sweep_dir / "members" / m["name"]
        records = read_metrics(run)
        if not any(r.get("diverged") for r in records):
            cfg = config_lib.from_dict(json.loads((run / "config.json").read_text()))
            yield m, cfg, [r for r in records if r["split"] == "val"]


def size_points(sweep_dir: Path) -> dict[str, dict[float, list[float]]]:
    """{arch: {parameters: [final validation loss per seed]}} (diverged members left out)."""
    out = {}
    for _, cfg, val in _runs(sweep_dir):
        if val:
            n = float(param_count(cfg.model)["params_paper"])  # one embedding matrix, as the paper's size names
            out.setdefault(cfg.model.arch, {}).setdefault(n, []).append(val[-1]["loss"])
    return out


def token_points(sweep_dir: Path) -> dict[str, dict[float, list[float]]]:
    """{arch: {tokens trained: [validation loss per seed]}} from every validation point."""
    out = {}
    for _, cfg, val in _runs(sweep_dir):
        for r in val:
            tokens = float(r["step"] * cfg.data.batch_size * cfg.data.seq_len)
            out.setdefault(cfg.model.arch, {}).setdefault(tokens, []).append(r["loss"])
    return out


def final_losses(sweep_dir: Path) -> dict[str, dict[str, dict[int, float]]]:
    """{point: {arch: {seed: final validation loss}}}; a point is a size (variant "<size>-<arch>") or, in the token
    study, "final"."""
    out = {}
    for m, cfg, val in _runs(sweep_dir):
        if val:
            point = m["variant"].rsplit("-", 1)[0] if "-" in m["variant"] else "final"
            out.setdefault(point, {}).setdefault(cfg.model.arch, {})[m["seed"]] = val[-1]["loss"]
    return out


def paired_rows(finals: dict[str, dict[str, dict[int, float]]]) -> list[dict]:
    """Per point, each arch's final validation loss minus the Transformer's, paired by seed (arms of one seed share
    data order and every common initial parameter): mean, 95 % bootstrap CI, paired t-test p."""
    rows = []
    for point, by_arch in finals.items():
        for arch, losses in by_arch.items():
            if arch != REFERENCE and REFERENCE in by_arch:
                d = paired(losses, by_arch[REFERENCE])
                rows.append({"point": point, "arch": arch, "n": d.n, "per_seed": list(d.diffs), "mean": d.mean,
                             "ci": list(d.ci), "p": d.p, "reading": d.verdict(arch, precision(4))})  # as printed
    return rows


def analyse(points: dict[str, dict[float, list[float]]], *, resamples: int = 500, seed: int = 0) -> dict:
    """Fits on the seed means, and each other arch's matching fraction against the Transformer with a bootstrap over
    seeds ("comparisons"); the headline and top-level fraction fields are DIFF's, else the first compared arch's."""
    result = {"fits": {}, "points": {a: {str(x): ys for x, ys in sorted(p.items())} for a, p in points.items()},
              "comparisons": {}}
    if REFERENCE not in points:
        return result | {"headline": f"the fit cannot tell: no {REFERENCE} points to compare with"}
    for arch, arch_points in points.items():
        xs = sorted(arch_points)
        if len(xs) < 3:
            return result | {"headline": "the fit cannot tell: fewer than 3 points for " + arch}
        result["fits"][arch] = fit_power_law(xs, [np.mean(arch_points[x]) for x in xs])
    if None in result["fits"].values():
        return result | {"headline": "the fit cannot tell: a power law did not converge"}
    for i, arch in enumerate(a for a in points if a != REFERENCE):
        result["comparisons"][arch] = _compare(arch, points, result["fits"], resamples, seed + i)
    main = "diff" if "diff" in result["comparisons"] else next(iter(result["comparisons"]), None)
    return result | (result["comparisons"][main] if main else {"headline": "the fit cannot tell: nothing to compare"})


def _compare(arch: str, points, fits, resamples: int, seed: int) -> dict:
    """`arch`'s fraction of the Transformer's parameters (tokens) at which it matches the Transformer's loss at the
    largest Transformer point, and its bootstrap over seeds (one seed per point, with replacement, refitted)."""
    x_ref = max(points[REFERENCE])
    name = "DIFF" if arch == "diff" else arch
    result = {"x_ref": x_ref, "fraction": matching_fraction(fits[arch], fits[REFERENCE], x_ref)}
    rng, samples, fitted = np.random.default_rng(seed), [], {}
    for _ in range(resamples):
        # few seeds give few distinct resamples (3 seeds at 4 points: 81 per arch): each is fitted once
        pair = []
        for a in (arch, REFERENCE):
            ys = tuple(rng.choice(points[a][x]) for x in sorted(points[a]))
            if (a, ys) not in fitted:
                fitted[a, ys] = fit_power_law(sorted(points[a]), ys)
            pair.append(fitted[a, ys])
        if None not in pair:
            samples.append(matching_fraction(*pair, x_ref))
    finite = np.array([s for s in samples if math.isfinite(s)])
    result |= {"bootstrap": len(samples), "bootstrap_finite": int(finite.size)}
    if finite.size < 0.8 * max(len(samples), 1):
        return result | {"headline": f"the fit cannot tell ({name}): only {finite.size}/{len(samples)} resamples "
                                     f"give a matching point"}
    lo, mid, hi = np.percentile(finite, [16, 50, 84])
    result |= {"fraction_median": float(mid), "fraction_16": float(lo), "fraction_84": float(hi)}
    if lo <= 1.0 <= hi:
        result["headline"] = (f"no difference the fit can tell at this scale: {name} matches the Transformer at "
                              f"{100 * mid:.0f} % (16–84 %: {100 * lo:.0f}–{100 * hi:.0f} %)")
    else:
        result["headline"] = (f"{name} matches the Transformer's loss at {x_ref:.3g} with {100 * mid:.0f} % of it "
                              f"(16–84 %: {100 * lo:.0f}–{100 * hi:.0f} %)")
    return result


def markdown(results: dict[str, dict]) -> str:
    lines = ["# Scaling (paper Fig. 3)", ""]
    for study, r in results.items():
        unit = "parameters" if study == "size" else "training tokens"
        others = [f"- {c['headline']}" for arch, c in r.get("comparisons", {}).items() if arch != "diff"]
        lines += [f"## {unit}", "", f"**{r['headline']}**", "", *others, *([""] if others else []),
                  "| arch | fit E | A | exponent |", "|---|---|---|---|"]
        for arch, fit in r["fits"].items():
            lines.append(f"| {arch} | {fit[0]:.4f} | {fit[1]:.4g} | {fit[2]:.4f} |" if fit else f"| {arch} | — |||")
        if r.get("paired"):
            lines += ["", "Final validation loss minus the Transformer's at each point, paired by seed:", "",
                      "| point | arch | n | per seed | mean difference | 95% CI | p | reading |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {row['point']} | {row['arch']} | {row['n']} | "
                      f"{', '.join(f'{d:+.4f}' for d in row['per_seed'])} | {row['mean']:+.4f} | {row['ci'][0]:+.4f} "
                      f"to {row['ci'][1]:+.4f} | {row['p']:.3g} | {row['reading']} |" for row in r["paired"]]
        lines += ["", f"| arch | {unit} | validation loss (mean ± std over seeds) | seeds |", "|---|---|---|---|"]
        for arch, arch_points in r["points"].items():
            for x, ys in sorted(((float(k), v) for k, v in arch_points.items())):
                lines.append(f"| {arch} | {x:.4g} | {mean_std(ys, 4)} | {len(ys)} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib.ticker

    from diffjax.plotting import save, subplots

    fig, axes = subplots(1, len(results), figsize=(5.5 * len(results), 4.4), squeeze=False)
    for ax, (study, r) in zip(axes[0], results.items(), strict=True):
        for arch, color in zip(r["points"], COLORS, strict=False):
            pts = {float(x): ys for x, ys in r["points"][arch].items()}
            xs = np.array(sorted(pts))
            if not len(xs):
                continue
            means = np.array([np.mean(pts[x]) for x in xs])
            stds = np.array([np.std(pts[x], ddof=1) if len(pts[x]) > 1 else 0.0 for x in xs])
            ax.errorbar(xs, means, yerr=stds, fmt="o", color=color, label=arch, capsize=3)
            if r["fits"].get(arch):
                grid = np.geomspace(xs.min(), xs.max(), 100)
                ax.plot(grid, power_law(grid, *r["fits"][arch]), color=color, alpha=0.7)
        ax.set(xscale="log", xlabel="parameters" if study == "size" else "training tokens",
               ylabel="validation loss")
        ax.set_title(textwrap.fill(r["headline"], 60), fontsize=9)
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))  # labels at 1, 2, 5 × 10^k
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend()
    save(fig, path)


def run_sweep(study: str, data: str, *, seeds: int = 3, sweep_dir: Path | None = None,
              progress: bool = False) -> Path | None:
    """Train (or resume) configs/scaling.py's CPU `study` ("size" or "tokens") on the corpus `data`; the sweep
    directory, or None if a signal stopped it (rerun to resume)."""
    spec = f"configs/scaling.py:study={study},scale=cpu,data={data},seeds={seeds}"
    return sweep_lib.run(spec, (), sweep_dir or Path(f"runs/sweeps/scaling-{study}-cpu"), progress=progress)


def report(size_sweep: Path | None = None, token_sweep: Path | None = None, out: Path | None = None) -> str:
    """Fit and compare the finished sweeps, write scaling.{json,md,png} into `out` (default: the first sweep's
    directory); the markdown."""
    for sweep_dir in (size_sweep, token_sweep):
        if sweep_dir and not (Path(sweep_dir) / "sweep.json").is_file():
            raise ConfigError(f"{sweep_dir} is not a sweep directory (no sweep.json): run the sweep first (--run)")
    results = {study: analyse(points(d)) | {"paired": paired_rows(final_losses(d))}
               for study, points, d in (("size", size_points, size_sweep), ("tokens", token_points, token_sweep)) if d}
    if not results:
        raise ConfigError("give a size sweep and/or a token sweep")
    out = Path(out or size_sweep or token_sweep)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(results, indent=2))
    md = markdown(results)
    (out / "scaling.md").write_text(md)
    plot(results, out / "scaling.png")
    return md

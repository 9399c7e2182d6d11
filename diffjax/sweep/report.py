"""A sweep's results, read from its directory (`sweep.json`, each member's `metrics.jsonl`), so a finished,
interrupted or running sweep can be reported: `results.{csv,md,png}` and `paired.csv` (docs/sweeps.md, "Outputs")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from diffjax import paths as paths_lib
from diffjax.stats import Paired, mean_std, paired, write_csv
from diffjax.train.metrics import read_metrics


def member_rows(workdir: Path) -> list[dict]:
    rows = []
    for m in json.loads((workdir / "sweep.json").read_text())["members"]:
        records = read_metrics(workdir / "members" / m["name"])
        train = {r["step"]: r for r in records if r["split"] == "train"}  # the last record of a step wins
        val = {r["step"]: r for r in records if r["split"] == "val"}
        last_val = val[max(val)] if val else {}
        diverged = any(r.get("diverged") for r in train.values())
        last_train = train[max(train)] if train else {}
        rows.append({"member": m["name"], "variant": m["variant"], "seed": m["seed"],
                     "step": last_train.get("step", 0), "val_loss": last_val.get("loss", math.nan),
                     "val_step": last_val.get("step", 0), "train_loss": last_train.get("loss", math.nan),
                     "diverged": diverged})
    return rows


def variant_rows(rows: list[dict]) -> list[dict]:
    out = {}
    for r in rows:
        out.setdefault(r["variant"], []).append(r)
    table = []
    for variant, members in out.items():
        ok = [r["val_loss"] for r in members if not r["diverged"] and math.isfinite(r["val_loss"])]
        table.append({"variant": variant, "seeds": len(members), "counted": len(ok), "loss": mean_std(ok, 4),
                      "diverged": sum(r["diverged"] for r in members)})
    return table


def paired_rows(rows: list[dict], reference: str) -> dict[str, Paired]:
    """{variant: its final validation loss minus the reference's, paired by seed} (diverged members out)."""
    by_variant: dict[str, dict[int, float]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], {})[r["seed"]] = math.nan if r["diverged"] else r["val_loss"]
    return {variant: paired(losses, by_variant[reference]) for variant, losses in by_variant.items()
            if variant != reference}


def write_report(workdir: str | Path) -> dict[str, Path]:
    workdir = paths_lib.run_dir(workdir)
    if not (workdir / "sweep.json").exists():
        raise FileNotFoundError(f"{workdir} is not a sweep directory: it has no sweep.json")
    rows = member_rows(workdir)
    variants = variant_rows(rows)
    spec = json.loads((workdir / "sweep.json").read_text())
    reference = spec["options"].get("reference") or variants[0]["variant"]
    differences = paired_rows(rows, reference)
    paired_csv = [{"variant": v, "reference": reference, "n": p.n, "mean_difference": p.mean, "ci_low": p.ci[0],
                   "ci_high": p.ci[1], "p": p.p, "per_seed": p.per_seed(), "sentence": p.sentence(v, reference)}
                  for v, p in differences.items()]
    paths = {"csv": workdir / "results.csv", "md": workdir / "results.md", "png": workdir / "results.png",
             "paired": workdir / "paired.csv"}
    write_csv(paths["csv"], rows)
    if differences:
        write_csv(paths["paired"], paired_csv)
    lines = [f"# Sweep {spec['name']}: final validation loss", "",
             "| variant | val loss (mean ± std over seeds) | seeds counted | diverged |", "|---|---|---|---|"]
    for v in variants:
        lines.append(f"| {v['variant']} | {v['loss']} | {v['counted']}/{v['seeds']} | {v['diverged']} |")
    if differences:
        lines += ["", f"Paired by seed against **{reference}** (each seed's difference; 95% bootstrap CI of the mean; "
                  "two-sided paired t-test):", "",
                  f"| variant − {reference} | n | per seed | mean difference | 95% CI | p | reading |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {v} | {p.cells(v)} |" for v, p in differences.items()]
        lines += [""] + [f"- {p.sentence(v, reference)}" for v, p in differences.items()]
    lines += ["", "| member | seed | step | val loss (at step) | diverged |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['member']} | {r['seed']} | {r['step']} | {r['val_loss']:.4f} ({r['val_step']}) | "
                     f"{'yes' if r['diverged'] else ''} |")
    paths["md"].write_text("\n".join(lines) + "\n")
    _plot(workdir, rows, paths["png"])
    return paths


def _plot(workdir: Path, rows: list[dict], path: Path) -> None:
    from diffjax.plotting import save, subplots

    fig, ax = subplots(figsize=(7, 4.5))
    by_variant = {}
    for r in rows:
        if not r["diverged"]:
            by_variant.setdefault(r["variant"], []).append(r["member"])
    for variant, names in by_variant.items():
        curves = [{rec["step"]: rec["loss"] for rec in read_metrics(workdir / "members" / name)
                   if rec["split"] == "train"} for name in names]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        values = np.array([[c[s] for s in steps] for c in curves])
        mean, std = values.mean(0), values.std(0, ddof=1) if len(values) > 1 else np.zeros(len(steps))
        line, = ax.plot(steps, mean, label=f"{variant} (n={len(values)})")
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="train loss", title=f"{workdir.name}: mean ± std over seeds")
    ax.legend(fontsize=8)
    save(fig, path)

"""The main job: DIFF and its matched Transformer on synthetic retrieval, several seeds per arch as one sweep, then
the retrieval and attention-noise protocols on every member: a table of each metric's mean ± std over seeds and
DIFF − Transformer paired by seed, `report.png`, `summary.json`, `summary.md` (docs/design.md §7, "Main job").

    diffjax train                       # no --config: this job, with configs/main.py (a few CPU minutes)
    diffjax train --config configs/main.py:seeds=5,steps=2000 --workdir runs/main5
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

from diffjax import distributed
from diffjax import eval as eval_lib
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval.attention_maps import answer_attention, attention_maps
from diffjax.eval.report import answer_attention_panel, plain_log_ticks
from diffjax.model import archs, layer_lambdas
from diffjax.stats import mean_std, paired
from diffjax.sweep import Sweep
from diffjax.sweep.report import write_report
from diffjax.sweep.runner import run_sweep
from diffjax.train.metrics import read_metrics
from diffjax.train.run_loader import load_run


def run(sweep: Sweep, workdir: Path, *, progress: bool = True) -> dict | None:
    """Train (or resume) the sweep, evaluate every member, print the table; None if interrupted."""
    result = run_sweep(sweep, workdir, progress=progress)
    if result.interrupted:
        print(f"interrupted: {result.interrupted}")
        return None
    per_member, shown = {}, {}  # shown: each variant's first member, whose attention map the figure draws
    example = figure_example(sweep)
    for i, m in enumerate(sweep.members, 1):
        if distributed.is_main():
            print(f"evaluating {m.name} ({i}/{len(sweep.members)}): retrieval, attention_noise", flush=True)
        cfg, state, _ = load_run(workdir / "members" / m.name)
        shown.setdefault(m.variant, (m, cfg, state.params))
        per_member[m.name] = {"arch": cfg.model.arch, "variant": m.variant, "seed": m.seed,
                              "retrieval": eval_lib.get("retrieval").run(cfg, state.params),
                              "attention_noise": eval_lib.get("attention_noise").run(cfg, state.params),
                              "val_loss": _final_val_loss(workdir / "members" / m.name),
                              "answer_attention": answer_attention(cfg.model, state.params, example).tolist()}
    summary = {"workdir": str(workdir), "members": per_member,
               "table": table(per_member, sweep.options.reference or None)}
    if not distributed.is_main():  # every process evaluated (replicated); process 0 writes
        return summary
    write_report(workdir)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    (workdir / "summary.md").write_text(f"# Main job: {workdir}\n\n{summary['table']}\n")
    png = write_figure(workdir, sweep, shown, per_member)
    print(summary["table"])
    print(f"report: {png}")
    return summary


def figure_example(sweep: Sweep) -> dict:
    """The one retrieval example every member's maps and Figure 1 row are drawn on (answer needle at depth 50 %)."""
    return retrieval_examples(sweep.members[0].config.data, 1, depth=0.5)  # the members' data, --set applied


def _final_val_loss(run_dir: Path) -> float:
    val = [r for r in read_metrics(run_dir) if r["split"] == "val"]
    return val[-1]["loss"] if val else math.nan


def table(per_member: dict, reference: str | None = None) -> str:
    """Mean ± std over seeds per variant; with a `reference` variant, each other variant's per-seed paired
    difference from it (mean, 95% bootstrap CI, paired t-test p)."""
    variants = sorted({m["variant"] for m in per_member.values()})
    groups = {v: [m for m in per_member.values() if m["variant"] == v] for v in variants}
    depths = list(next(iter(per_member.values()))["retrieval"]["by_depth"])
    rows = [("exact retrieval, mean over depths", lambda m: m["retrieval"]["mean"])]
    rows += [(f"  answer at depth {float(d):.0%}", lambda m, d=d: m["retrieval"]["by_depth"][d]) for d in depths]
    rows += [("answer tokens right (per token, all depths)", lambda m: m["retrieval"]["answer_token_accuracy"]),
             ("attention on the answer span", lambda m: float(np.mean(m["attention_noise"]["answer"]))),
             ("attention on the rest of the context (noise)", lambda m: float(np.mean(m["attention_noise"]["noise"]))),
             ("final validation loss", lambda m: m["val_loss"])]
    others = [v for v in variants if v != reference] if reference in groups else []
    lines = ["| metric (mean ± std over seeds) | " + " | ".join(f"{v} ({len(groups[v])} seeds)" for v in variants)
             + "".join(f" | {v} − {reference}, paired by seed [95% CI] p" for v in others) + " |",
             "|---" * (len(variants) + len(others) + 1) + "|"]
    readings = []
    for label, get in rows:
        cells = [mean_std([get(m) for m in groups[v]]) for v in variants]
        by_seed = {v: {m["seed"]: get(m) for m in groups[v]} for v in variants}
        differences = {v: paired(by_seed[v], by_seed[reference]) for v in others}
        cells += [d.brief() for d in differences.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if not label.startswith(" "):  # the headline rows, not each depth
            readings += [f"- {d.sentence(v, reference, label)}" for v, d in differences.items()]
    return "\n".join(lines + ([""] + readings if readings else []))


def write_figure(workdir: Path, sweep: Sweep, shown: dict, per_member: dict) -> Path:
    """Loss curves, the paper's Figure 1 view (the answer's query attending over the keys) and each arch's last-layer
    map on the same example (`shown`: variant -> (member, config, params)), titled with its exact retrieval and λ."""
    from diffjax.plotting import save, subplots

    variants = sorted({m.variant for m in sweep.members})
    panels = 2 + len(variants)
    cols = 2 if panels == 4 else min(panels, 3)  # at most three panels a row, so titles stay readable
    rows = -(-panels // cols)
    # constrained layout places the suptitle and the colorbars itself (tight_layout left a gap under the title)
    fig, axes = subplots(rows, cols, figsize=(5.6 * cols, 5.2 * rows + 0.6), squeeze=False, layout="constrained")
    axes = axes.ravel()
    for unused in axes[panels:]:
        unused.axis("off")
    ax = axes[0]
    for variant in variants:
        curves = [{r["step"]: r["loss"] for r in read_metrics(workdir / "members" / m.name) if r["split"] == "train"}
                  for m in sweep.members if m.variant == variant]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        mean = values.mean(0)
        std = values.std(0, ddof=1) if len(values) > 1 else np.zeros_like(mean)
        line, = ax.plot(steps, mean, "o-" if len(steps) < 3 else "-", markersize=3,
                        label=f"{variant} (n={len(values)})")
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="train loss (answer tokens)", yscale="log", title="loss, mean ± std over seeds")
    plain_log_ticks(ax)
    ax.legend(fontsize=8)

    example = figure_example(sweep)
    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    query = int(example["answer_start"][0, 0])  # the position whose logits predict the first answer token
    answer_attention_panel(axes[1], {v: np.array([r["answer_attention"] for r in per_member.values()
                                                  if r["variant"] == v]) for v in variants}, (start, end), query)
    for col, variant in enumerate(variants, start=2):
        member, cfg, params = shown[variant]
        maps = attention_maps(cfg.model, params, example["tokens"], example["positions"], example["segment_ids"])
        m = np.asarray(maps[-1, 0]).mean(0)[: query + 1, : query + 1]  # last layer, mean over heads
        lim = np.percentile(np.abs(m[np.tril_indices_from(m)]), 99.5)
        ax = axes[col]
        image = ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
        ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.3, label="answer needle")
        ax.axhline(query, color="lime", lw=3, label="query predicting the answer (the bottom edge)")
        accuracy = mean_std([r["retrieval"]["mean"] for r in per_member.values() if r["variant"] == variant])
        seeds = sum(r["variant"] == variant for r in per_member.values())
        lambdas = layer_lambdas(params, cfg.model)
        lam = "" if lambdas is None else "\nλ by layer = " + " / ".join(f"{float(x):.2f}" for x in lambdas)
        ax.set_title(f"{variant}: exact retrieval {accuracy} ({seeds} seeds)\n{member.name.split('__')[-1]}, last "
                     f"layer: {archs.get(cfg.model.arch).map_label}, mean over {cfg.model.n_heads} heads{lam}",
                     fontsize=10)  # the longest map labels (sink's) fit a panel's width
        ax.set(xlabel="key", ylabel="query")
        ax.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"one retrieval example, the same for every arch: the answer needle (gold) at depth "
                 f"{float(example['depth'][0]):.0%} of the context\nexact retrieval: mean over depths, mean ± std "
                 f"over seeds (as in the table)")
    path = workdir / "report.png"
    save(fig, path)
    return path


def table_cells(markdown: str) -> dict[str, dict[str, tuple[float, ...]]]:
    """The numbers of a `table()` (a summary.md, or the README's copy): {metric: {column: numbers}}, where an arch's
    column ("diff") holds (mean, std over seeds) and a paired one ("diff − transformer") (mean, CI low, CI high)."""
    text = markdown.splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("| metric (mean ± std over seeds)"))
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), text[start:]))
    columns = [cell.strip().split(" (")[0].split(", paired")[0] for cell in lines[0].split("|")[2:-1]]
    out = {}
    for line in lines[2:]:
        label, *cells = [cell.strip() for cell in line.split("|")[1:-1]]
        out[label] = {column: tuple(float(x) for x in re.findall(r"[-+]?\d+\.\d+", cell.split(" p=")[0]))
                      for column, cell in zip(columns, cells, strict=True)}
    return out


def disagreements(expected: str, fresh: str) -> list[str]:
    """Where a fresh main-job table departs from an expected one (the README's): an arch's mean outside the expected
    mean ± std, a paired difference outside the expected 95 % CI (each widened by half a printed last digit)."""
    out = []
    got = table_cells(fresh)
    for metric, columns in table_cells(expected).items():
        for column, numbers in columns.items():
            value = got.get(metric, {}).get(column)
            if not value or not numbers:
                out.append(f"{metric} / {column}: missing from the fresh table")
                continue
            if len(numbers) == 3:
                lo, hi = numbers[1], numbers[2]
            else:
                spread = numbers[1] if len(numbers) > 1 else 0.0
                lo, hi = numbers[0] - spread, numbers[0] + spread
            if not lo - 5e-4 <= value[0] <= hi + 5e-4:
                out.append(f"{metric} / {column}: {value[0]:+.3f}, expected within [{lo:+.3f}, {hi:+.3f}]")
    return out

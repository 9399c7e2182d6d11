"""Fig. 8 of the paper at CPU scale: DIFF against the Transformer with absmax-quantized attention logits, over seeds,
at every granularity, with DIFF's two maps by their own scales or one shared scale, and per layer the error the
quantization puts into the attention map beside λ (the `quantization` protocol on every finished member).

    report({"retrieval": Path("runs/main"), "text": Path("runs/sweeps/ablation-cpu")}, Path("runs/studies/quant"))

Each member's results are kept in `out/members/TASK__MEMBER.json` as each setting finishes: a rerun evaluates only
what is missing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from diffjax import eval as protocols
from diffjax.config import ConfigError
from diffjax.eval.quantization import NONE_BITS
from diffjax.kernels.quantized import GRANULARITIES
from diffjax.model import archs
from diffjax.stats import mean_std, paired, write_csv
from diffjax.train.run_loader import load_run

BITS = (NONE_BITS, 8, 6, 4)  # the paper's widths; 16 is the unquantized model
ARMS = {"diff": "DIFF", "transformer": "Transformer"}  # the sweep variants compared, DIFF − Transformer
SCALES = {False: "own", True: "shared"}  # DIFF's two maps: a scale each, or one for both (one map: the same)
# metric: (label, digits printed, +1 where higher is better)
METRICS = {"retrieval_accuracy": ("exact retrieval", 3, +1), "val_loss": ("validation loss", 4, -1)}


def _setting(granularity: str, shared: bool) -> str:
    return f"{granularity}/{SCALES[shared]}"


def _two_maps(arch: str) -> bool:
    """Does a shared scale change anything: the arch's op quantizes two maps apart."""
    return "diff_attention" in archs.get(arch).ops


def evaluate(task: str, sweep_dir: Path, out: Path, *, batches: int, retrieval_n: int, bits: tuple[int, ...] = BITS,
             granularities: tuple[str, ...] = GRANULARITIES) -> list[dict]:
    """The quantization protocol at every setting on each finished DIFF and Transformer member of `sweep_dir`:
    [{"task", "variant", "seed", "member", "results": {setting: protocol result}}]."""
    options = {"bits": list(bits), "eval_batches": batches, "retrieval_n": retrieval_n, "seed": 0}
    rows = []
    for m in json.loads((sweep_dir / "sweep.json").read_text())["members"]:
        run = sweep_dir / "members" / m["name"]
        if m["variant"] not in ARMS:
            continue
        if not (run / "checkpoints").is_dir():
            print(f"{task}: {m['name']} has not finished: left out")
            continue
        path = out / "members" / f"{task}__{m['name']}.json"
        saved = json.loads(path.read_text()) if path.exists() else {"run": str(run), "options": options,
                                                                    "results": {}}
        if saved["options"] != options:
            raise ConfigError(f"{path} was evaluated with {saved['options']}, not {options}: give another --out")
        loaded = None
        for granularity in granularities:
            for shared in SCALES:
                key = _setting(granularity, shared)
                if key in saved["results"] or (shared and not _two_maps(_arch_of(m, sweep_dir))):
                    continue
                loaded = loaded or load_run(run)
                cfg, state, _ = loaded
                print(f"{task}: {m['name']} at {key}", flush=True)
                saved["results"][key] = protocols.get("quantization").run(
                    cfg, state.params, bits=bits, granularity=granularity, shared_scale=shared, eval_batches=batches,
                    retrieval_n=retrieval_n, seed=0)
                _write_json(path, saved)
        rows.append({"task": task, "variant": m["variant"], "seed": m["seed"], "member": m["name"],
                     "results": saved["results"]})
    return rows


def _arch_of(member: dict, sweep_dir: Path) -> str:
    """A member's arch, from its config.json."""
    return json.loads((sweep_dir / "members" / member["name"] / "config.json").read_text())["model"]["arch"]


def _write_json(path: Path, data) -> None:
    """Write whole or not at all: an interrupted study resumes from the last setting that finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _result(row: dict, granularity: str, shared: bool) -> dict | None:
    """A member's result at a setting; a one-map arch's own-scale result stands for its shared one (identical)."""
    results = row["results"]
    return results.get(_setting(granularity, shared)) or results.get(_setting(granularity, False))


def _widths(rows: list[dict]) -> list[int]:
    """The bit widths evaluated, widest (unquantized) first."""
    return sorted({b for row in rows for r in row["results"].values() for b in r["bits"]}, reverse=True)


def _granularities(rows: list[dict]) -> list[str]:
    found = {key.split("/")[0] for row in rows for key in row["results"]}
    return [g for g in GRANULARITIES if g in found]


def _by_seed(rows: list[dict], task: str, variant: str, granularity: str, shared: bool, metric: str,
             bits: int, *, drop: bool = False) -> dict[int, float]:
    """{seed: metric at `bits`}; with `drop`, how much worse than unquantized (positive: worse)."""
    out = {}
    for row in rows:
        r = row["task"] == task and row["variant"] == variant and _result(row, granularity, shared)
        if not r or metric not in r or bits not in r["bits"]:
            continue
        value = r[metric][r["bits"].index(bits)]
        if drop:
            value = -METRICS[metric][2] * (value - r[metric][r["bits"].index(NONE_BITS)])
        out[row["seed"]] = value
    return out


def _metrics(rows: list[dict], task: str) -> list[str]:
    present = [m for m in METRICS if any(m in r for row in rows if row["task"] == task
                                         for r in row["results"].values())]
    return present


def metric_table(rows: list[dict], task: str, metric: str) -> str:
    """Per setting and width: each arm's mean ± std, DIFF − Transformer paired by seed, and the same for each arm's
    drop from 16 bits (negative: DIFF loses less, the paper's direction)."""
    label, digits, _ = METRICS[metric]
    lines = [f"**{task}: {label}** (mean ± std over seeds; DIFF − Transformer paired by seed: mean [95% CI] p, and "
             f"the reading; drop = how much worse than 16 bits)", "",
             "| granularity | DIFF's maps | bits | DIFF | Transformer | DIFF − Transformer | reading "
             "| drop: DIFF − Transformer | reading |", "|---" * 9 + "|"]
    widths = _widths(rows)
    for granularity in _granularities(rows):
        for shared in SCALES:
            for bits in widths[1:] if shared else widths:
                arms = {v: _by_seed(rows, task, v, granularity, shared, metric, bits) for v in ARMS}
                if not all(arms.values()):
                    continue
                level = paired(arms["diff"], arms["transformer"])
                cells = [mean_std(list(arms[v].values()), digits) for v in ARMS]
                drop = paired(*(_by_seed(rows, task, v, granularity, shared, metric, bits, drop=True) for v in ARMS))
                reading = level.verdict("DIFF", 10.0**-digits)
                drop_cells = ["—", "—"] if bits == NONE_BITS else [drop.brief(digits),
                                                                  drop.verdict("DIFF's drop", 10.0**-digits)]
                lines.append(f"| {granularity} | {SCALES[shared]} | {bits} | {' | '.join(cells)} | "
                             f"{level.brief(digits)} | {reading} | {' | '.join(drop_cells)} |")
    return "\n".join(lines) + "\n"


def _layer_means(rows, task, variant, granularity, shared, key, bits) -> list[float]:
    """Per seed, the mean over layers of a per-layer quantity at `bits` (nan where not measured)."""
    out = []
    for row in rows:
        r = row["task"] == task and row["variant"] == variant and _result(row, granularity, shared)
        if r and key in r and bits in r["bits"]:
            values = [v for v in r[key][r["bits"].index(bits)] if v is not None]
            out.append(float(np.mean(values)) if values else math.nan)
    return out


def error_table(rows: list[dict], task: str) -> str:
    """The relative error quantization puts into the attention map P (DIFF's A1 − λA2, the Transformer's A) and into
    the heads P V it makes (what a head norm scales back up), beside the error of DIFF's softmax maps themselves
    (A1, A2 each); mean over layers, mean ± std over seeds; and λ by layer."""
    columns = (("diff", "map_error"), ("diff", "softmax_error"), ("diff", "output_error"),
               ("transformer", "map_error"), ("transformer", "output_error"))
    lines = [f"**{task}: relative error of the quantized attention** (‖Q(x) − x‖ / ‖x‖ over the real query rows, "
             f"mean over layers; mean ± std over seeds)", "",
             "| granularity | DIFF's maps | bits | DIFF: A1 − λA2 | DIFF: A1, A2 | DIFF: (A1 − λA2) V "
             "| Transformer: A | Transformer: A V |", "|---" * 8 + "|"]
    for granularity in _granularities(rows):
        for shared in SCALES:
            for bits in _widths(rows)[1:]:
                cells = [mean_std(_layer_means(rows, task, variant, granularity, shared, key, bits), 4)
                         for variant, key in columns]
                if "—" not in cells:
                    lines.append(f"| {granularity} | {SCALES[shared]} | {bits} | {' | '.join(cells)} |")
    lams = np.array([r["lambda"] for row in rows if row["task"] == task and row["variant"] == "diff"
                     for r in list(row["results"].values())[:1]], np.float64)
    if lams.size:
        per_layer = ", ".join(f"layer {i}: {mean_std(lams[:, i], 3)}" for i in range(lams.shape[1]))
        lines += ["", f"DIFF's λ (mean over heads; mean ± std over seeds): {per_layer}."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], tasks: list[str], path: Path) -> None:
    """One row of panels per (task, metric), one panel per granularity: each arm's mean over seeds against the
    bits (16 on the left, as in Fig. 8), the band from its lowest to its highest seed."""
    from diffjax.plotting import save, subplots

    panels = [(task, metric) for task in tasks for metric in _metrics(rows, task)
              if not (metric == "val_loss" and "retrieval_accuracy" in _metrics(rows, task))]
    granularities, widths = _granularities(rows), _widths(rows)
    fig, axes = subplots(len(panels), len(granularities), figsize=(4.2 * len(granularities), 3.2 * len(panels)),
                         squeeze=False)
    x = np.arange(len(widths))
    lines = [("diff", False, "DIFF, own scales", "C0", "-"), ("diff", True, "DIFF, one shared scale", "C0", "--"),
             ("transformer", False, "Transformer", "C1", "-")]
    for (task, metric), row_axes in zip(panels, axes, strict=True):
        for granularity, ax in zip(granularities, row_axes, strict=True):
            for variant, shared, label, color, style in lines:
                values = [_by_seed(rows, task, variant, granularity, shared, metric, b) for b in widths]
                if not all(values):
                    continue
                per_bits = [np.array(list(v.values())) for v in values]
                ax.plot(x, [v.mean() for v in per_bits], style, color=color, marker="o", label=label)
                ax.fill_between(x, [v.min() for v in per_bits], [v.max() for v in per_bits], color=color,
                                alpha=0.15 if not shared else 0.08)
            ax.set_xticks(x, [str(b) for b in widths])
            ax.set(title=f"{task}, per {granularity}", xlabel="attention-logit bits", ylabel=METRICS[metric][0])
    axes[0][0].legend(fontsize=8)
    save(fig, path)


def report(tasks: dict[str, Path], out: Path, *, batches: int = 8, retrieval_n: int = 64, bits: tuple[int, ...] = BITS,
           granularities: tuple[str, ...] = GRANULARITIES) -> str:
    """Evaluate what is missing, then write quantization.{md,json,csv,png} into `out`; the markdown."""
    if NONE_BITS not in bits or set(granularities) - set(GRANULARITIES):
        raise ConfigError(f"bits must include {NONE_BITS} (unquantized, what the drops are from), got {bits}; "
                          f"granularities must be among {GRANULARITIES}, got {granularities}")
    for task, sweep_dir in tasks.items():
        if not (sweep_dir / "sweep.json").is_file():
            raise ConfigError(f"{task}: {sweep_dir} is not a sweep directory (no sweep.json)")
    rows = [r for task, d in tasks.items() for r in evaluate(task, d, out, batches=batches, retrieval_n=retrieval_n,
                                                                bits=bits, granularities=granularities)]
    if not rows:
        raise ConfigError(f"no DIFF or Transformer member of {', '.join(map(str, tasks.values()))} has finished")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantization.json").write_text(json.dumps(rows, indent=1))
    write_csv(out / "quantization.csv", [
        {"task": row["task"], "variant": row["variant"], "seed": row["seed"], "setting": setting, "bits": b,
         **{m: r[m][i] for m in METRICS if m in r}}
        for row in rows for setting, r in row["results"].items() for i, b in enumerate(r["bits"])])
    plot(rows, list(tasks), out / "quantization.png")
    sources = ", ".join(f"{task}: {d}" for task, d in tasks.items())
    seeds = {task: sorted({r["seed"] for r in rows if r["task"] == task}) for task in tasks}
    md = (f"# Attention-logit quantization (paper Fig. 8) over seeds\n\nRuns: {sources}; seeds {seeds}; "
          f"{batches} validation batches, {retrieval_n} retrieval examples per depth.\n\n"
          + "\n".join(metric_table(rows, task, m) for task in tasks for m in _metrics(rows, task)) + "\n"
          + "\n".join(error_table(rows, task) for task in tasks))
    (out / "quantization.md").write_text(md)
    return md

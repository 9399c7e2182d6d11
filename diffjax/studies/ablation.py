"""Table 6 of the paper from the ablation sweep (configs/ablation.py): per row #heads, d, GN and the validation,
AR-Hit and Others losses, mean ± std over seeds (docs/sweeps.md, "Ablation report").

    report(run_sweep(data="corpus.txt", seeds=3), batches=8)      # experiments/ablation.py --run --data corpus.txt
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np

from diffjax import eval as protocols
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError
from diffjax.eval.position_loss import labels as position_labels
from diffjax.model import archs
from diffjax.stats import mean_std, paired, write_csv
from diffjax.train import run_config
from diffjax.train.metrics import read_metrics
from diffjax.train.run_loader import load_run

# the paper's row labels, in Table 6's order (configs/ablation.py's variant names)
ROWS = {"transformer": "Transformer", "transformer-wide": "Transformer", "transformer-wide+gn": "+ GroupNorm",
        "diff": "DIFF Transformer", "diff-gn": "− GroupNorm", "diff-lambda0.8": "with λ_init = 0.8",
        "diff-lambda0.5": "with λ_init = 0.5", "diff_v2": "DIFF V2", "diff-split": "DIFF, 2h heads of d/2"}
COLUMNS = (("loss", "Valid. loss"), ("ar_hit_loss", "AR-Hit"), ("others_loss", "Others"))


def _members(sweep_dir: Path) -> list[dict]:
    return json.loads((Path(sweep_dir) / "sweep.json").read_text())["members"]


def _by_seed(rows: list[dict], variant: str, key: str) -> dict[int, float]:
    """{seed: `key`} of a variant's rows; nan for a diverged member (left out of paired differences)."""
    return {r["seed"]: math.nan if r["diverged"] else r[key] for r in rows if r["variant"] == variant}


def evaluate(sweep_dir: Path, batches: int) -> list[dict]:
    rows = []
    for m in _members(sweep_dir):
        run = sweep_dir / "members" / m["name"]
        if not (run / "checkpoints").is_dir():  # its group has not finished yet: the table says so
            print(f"{m['name']}: not finished, left out")
            continue
        cfg, state, _ = load_run(run)
        diverged = any(r.get("diverged") for r in read_metrics(run))
        result = protocols.get("ar_hit").run(cfg, state.params, batches=batches)
        by_position = protocols.get("position_loss").run(cfg, state.params, batches=batches)
        model = cfg.model
        rows.append({"variant": m["variant"], "seed": m["seed"], "member": m["name"], "run": str(run),
                     "arch": model.arch,
                     "heads": model.n_heads, "head_dim": model.head_dim, "gn": archs.uses_headwise_norm(model),
                     "lambda_init": "schedule" if model.lambda_init is None else model.lambda_init,
                     "diverged": diverged, "step": int(state.step), "tokens": result["tokens"],
                     **{key: result[key] for key, _ in COLUMNS},
                     **{f"loss_seen_{label}": x for label, x in zip(position_labels(by_position["edges"]),
                                                                   by_position["loss"], strict=True)}})
    return rows


def _ordered(variants: set[str]) -> list[str]:
    """Table 6's rows in its order, then any others (baselines=...) by name."""
    return [v for v in ROWS if v in variants] + sorted(variants - set(ROWS))


def table(rows: list[dict]) -> str:
    lines = ["| Model | #heads | d | GN | " + " | ".join(h for _, h in COLUMNS) + " | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for variant in _ordered({r["variant"] for r in rows}):
        group = [r for r in rows if r["variant"] == variant]
        ok = [r for r in group if not r["diverged"]]
        first = group[0]
        cells = [mean_std([r[key] for r in ok], 4) for key, _ in COLUMNS]
        lines.append(f"| {ROWS.get(variant, variant)} | {first['heads']} | {first['head_dim']} | "
                     f"{'✓' if first['gn'] else '✗'} | " + " | ".join(cells) + f" | {len(ok)}/{len(group)} |")
    return "\n".join(lines) + "\n"


def paired_table(rows: list[dict], reference: str = "diff") -> str:
    """Each row's validation loss minus the DIFF Transformer's, paired by seed: mean, 95% CI, paired t-test."""
    variants = _ordered({r["variant"] for r in rows})
    if reference not in variants:
        return ""
    lines = [f"Validation loss minus {ROWS[reference]}'s, paired by seed:", "",
             "| Model | n | per seed | mean difference | 95% CI | p | reading |", "|---|---|---|---|---|---|---|"]
    for variant in [v for v in variants if v != reference]:
        d = paired(_by_seed(rows, variant, "loss"), _by_seed(rows, reference, "loss"))
        lines.append(f"| {ROWS.get(variant, variant)} ({variant}) | {d.cells(variant)} |")
    return "\n".join(lines) + "\n"


def position_table(rows: list[dict], reference: str = "transformer") -> str:
    """The validation loss by position (`position_loss`: tokens of the document seen), mean ± std per row, and each
    row's difference from the reference row per bin, paired by seed: a long-range gain shows in the late bins."""
    bins = [k.removeprefix("loss_seen_") for k in rows[0] if k.startswith("loss_seen_")]
    variants = _ordered({r["variant"] for r in rows})
    if not bins or reference not in variants:
        return ""
    header = ["| Model | " + " | ".join(bins) + " |", "|---" * (len(bins) + 1) + "|"]
    lines = ["Validation loss by position (tokens of the document seen), mean ± std over seeds:", "", *header]
    for variant in variants:
        ok = [r for r in rows if r["variant"] == variant and not r["diverged"]]
        lines.append(f"| {ROWS.get(variant, variant)} ({variant}) | "
                     + " | ".join(mean_std([r[f"loss_seen_{b}"] for r in ok], 4) for b in bins) + " |")
    lines += ["", f"Minus {ROWS.get(reference, reference)}'s, paired by seed: mean [95% CI], p", "", *header]
    for variant in [v for v in variants if v != reference]:
        cells = [paired(_by_seed(rows, variant, f"loss_seen_{b}"), _by_seed(rows, reference, f"loss_seen_{b}")).brief(4)
                 for b in bins]
        lines.append(f"| {ROWS.get(variant, variant)} ({variant}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _milestones(steps: list[int]) -> list[int]:
    """The first step, each step at least twice the last one kept, and the last: early training in detail."""
    kept = steps[:1]
    for s in steps[1:]:
        if s >= 2 * kept[-1] or s == steps[-1]:
            kept.append(s)
    return kept


def along_training(sweep_dir: Path, rows: list[dict], reference: str = "transformer") -> str:
    """Each row's validation loss minus the reference row's at every validation step, paired by seed (does a gap
    close?), and per row the telemetry at a few steps (mean over layers, then mean ± std over seeds)."""
    by_member = {r["member"]: (r["variant"], r["seed"],
                               read_metrics(Path(r["run"]) if "run" in r else sweep_dir / "members" / r["member"]))
                 for r in rows}
    val: dict[str, dict[int, dict[int, float]]] = {}  # variant -> step -> seed -> loss
    for variant, seed, records in by_member.values():
        for rec in records:
            if rec["split"] == "val":
                val.setdefault(variant, {}).setdefault(rec["step"], {})[seed] = rec["loss"]
    if reference not in val:
        return ""
    lines = [f"Validation loss minus {ROWS.get(reference, reference)}'s along training, paired by seed:", "",
             "| step | Model | n | per seed | mean difference | 95% CI | p | reading |", "|---" * 8 + "|"]
    for step in sorted(val[reference]):
        for variant in [v for v in _ordered(set(val)) if v != reference and step in val[v]]:
            d = paired(val[variant][step], val[reference][step])
            lines.append(f"| {step} | {ROWS.get(variant, variant)} ({variant}) | {d.cells(variant)} |")

    def layer_mean(records, split, key, step):
        """The layer mean of `key` in the last `split` record at or before `step`; nan where there is none, or where
        the member has not reached `step` yet (a running sweep: no stale numbers)."""
        found = [r for r in records if r["split"] == split and r["step"] <= step and key in r]
        reached = max((r["step"] for r in records), default=-1) >= step
        return float(np.mean(found[-1][key])) if found and reached else math.nan

    steps = _milestones(sorted({r["step"] for _, _, records in by_member.values() for r in records
                                if r["split"] == "telemetry"}))
    columns = (("telemetry", "head_rms", "head RMS before norm"), ("telemetry", "head_rms_normed", "after norm"),
               ("train", "grad_norm_attn", "attention grad norm"), ("train", "lambda", "λ"))
    lines += ["", "Telemetry (mean over layers; mean ± std over seeds; the last record at or before the step, of the "
              "members that reached it):", "",
              "| step | Model | " + " | ".join(label for *_, label in columns) + " |",
              "|---" * (len(columns) + 2) + "|"]
    for step in steps:
        for variant in _ordered({v for v, _, _ in by_member.values()}):
            members = [records for v, _, records in by_member.values() if v == variant]
            cells = [mean_std([layer_mean(m, split, key, step) for m in members]) for split, key, _ in columns]
            lines.append(f"| {step} | {ROWS.get(variant, variant)} ({variant}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_sweep(data: str, *, sweep_dir: Path | None = None, scale: str = "cpu", seeds: int = 3, rows: str = "",
              baselines: str = "", overrides: tuple[str, ...] = (), progress: bool = False) -> Path | None:
    """Train (or resume) configs/ablation.py on the corpus `data`; the sweep directory, or None if a signal stopped
    it (rerun to resume)."""
    spec = f"configs/ablation.py:scale={scale},data={data},seeds={seeds},rows={rows},baselines={baselines}"
    return sweep_lib.run(spec, overrides, sweep_dir or Path(f"runs/sweeps/ablation-{scale}"), progress=progress)


def report(sweep_dir: Path, batches: int = 8, joined: tuple[Path, ...] = ()) -> str:
    """Evaluate every finished member and write ablation.{csv,json,md} into `sweep_dir`; the markdown. `joined`:
    sweeps of the same recipe (data, optimizer, steps) whose rows join the tables, e.g. a row trained later."""
    recipe = _recipe(sweep_dir)
    for other in joined:
        if _recipe(other) != recipe:
            raise ConfigError(f"{other} was trained with another recipe (data, optimizer or steps) than {sweep_dir}: "
                              "its rows cannot be paired with it")
    members = [m for d in (sweep_dir, *joined) for m in _members(d)]
    repeated = [key for key, n in collections.Counter((m["variant"], m["seed"]) for m in members).items() if n > 1]
    if repeated:
        raise ConfigError(f"rows trained twice across the sweeps: {sorted(repeated)}")
    rows = [r for d in (sweep_dir, *joined) for r in evaluate(d, batches)]
    if not rows:
        raise ConfigError(f"{sweep_dir}: no member has finished yet")
    write_csv(sweep_dir / "ablation.csv", rows)
    (sweep_dir / "ablation.json").write_text(json.dumps(rows, indent=2))
    sources = f"Rows from {', '.join(str(d) for d in (sweep_dir, *joined))}.\n\n" if joined else ""
    md = ("# Ablation (paper Table 6): mean ± std over seeds\n\n" + sources + table(rows) + "\n" + paired_table(rows)
          + "\n" + position_table(rows) + "\n" + along_training(sweep_dir, rows))
    (sweep_dir / "ablation.md").write_text(md)
    return md


def _recipe(sweep_dir: Path) -> tuple:
    """What members of a sweep share and rows from several sweeps must share to be paired: data, optimizer, steps."""
    cfg = run_config.load(Path(sweep_dir) / "members" / _members(sweep_dir)[0]["name"])
    return cfg.data, cfg.optim, cfg.train.steps

"""Where a train step's time goes on an accelerator, DIFF beside the Transformer, from a CPU host (no device;
docs/compile.md, "Where does the step's time go?").

    python experiments/step_profile.py --out runs/step_profile        # 1.4B, T = 2K and 4K, batch 4, h100x1
    python experiments/step_profile.py --seq-lens 2048 --set model.n_layers=2 --out /tmp/sp      # a quick look
    python experiments/step_profile.py --out /tmp/sp --reuse --chips h100,h200     # the report again, other peaks
    python experiments/step_profile.py --archs diff,diff:model.attention_impl=cudnn_wide_v,transformer --out /tmp/sp
    python experiments/step_profile.py --target v5e-8 --batch 32 --set mesh.data=1 --set mesh.fsdp=-1 --chips v5e

Each arch's `diffjax compile` step (with the `--set` overrides and its own, `arch:key=value+key=value`) is compiled
deviceless for --target, its optimized HLO kept in --out (`<arch>_T<seq>.hlo.txt`, read back by `--reuse`); report.md
puts the archs' kernels side by side (the last arch is the baseline), kernels.json has every kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import time
from importlib import metadata
from pathlib import Path

# The device check's 1.4B step on one H200 (docs/benchmarks.md, "Device check: NVIDIA H200", run 2: DIFF on `cudnn`),
# and run 3's attention alone (forward+backward, 3B head shape, B = 1: DIFF's cuDNN composition / standard cuDNN).
MEASURED = {"config": "configs/paper.py:size=1.4B", "batch": 4, "chip": "H200",
            "steps": {2048: {"ratio": 1.248, "diff_s": 0.264, "transformer_s": 0.211},
                      4096: {"ratio": 1.336, "diff_s": 0.601, "transformer_s": 0.450}},
            "attention_ratio": {2048: 1.470, 4096: 1.868}}
GROUPINGS = {"category": lambda k: k.category, "phase": lambda k: k.phase, "scope": lambda k: k.scope}


def parse_archs(text: str) -> dict[str, tuple[str, list[str]]]:
    """`diff,diff:model.attention_impl=cudnn_wide_v,transformer` -> {label: (arch, overrides)}, labels such as
    "diff[cudnn_wide_v]"."""
    archs = {}
    for item in text.split(","):
        arch, _, sets = item.partition(":")
        overrides = [o for o in sets.split("+") if o]
        if any("=" not in o for o in overrides):
            raise ValueError(f"--archs: {item!r}: overrides are key=value, joined by '+'")
        label = f"{arch}[{'+'.join(o.split('=', 1)[1] for o in overrides)}]" if overrides else arch
        archs[label] = (arch, overrides)
    if len(archs) < 2:
        raise ValueError("--archs needs two or more archs (the last is the baseline)")
    return archs


def compile_hlo(spec: str, arch: str, seq: int, batch: int, overrides: list[str], target_name: str) -> dict:
    """One arch's step compiled for the target: its optimized HLO text and what the compile reports."""
    from diffjax import config as config_lib
    from diffjax.aot import targets
    from diffjax.aot.compile import lower_train_step
    from diffjax.bench.train import with_arch
    from diffjax.flops import train_flops_per_token

    cfg = config_lib.load(with_arch(spec, arch), [*overrides, f"data.seq_len={seq}", f"data.batch_size={batch}"])
    lowered = lower_train_step(cfg, targets.parse(target_name))
    start = time.perf_counter()
    with targets.uncached():
        compiled = lowered.step.compile()
    return {"hlo": compiled.as_text(), "compile_s": round(lowered.lower_s + time.perf_counter() - start, 1),
            "kernels_used": lowered.kernels, "device_kind": lowered.devices[0].device_kind,
            "devices": len(lowered.devices),
            "model_flops": train_flops_per_token(lowered.cfg.model, seq) * batch * seq / len(lowered.devices)}


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _cells(g: dict | None) -> str:
    if not g:
        return "– | – | – | –"
    return f"{g['launches']:,} | {g['flops'] / 1e12:.2f} | {g['bytes'] / 1e9:.2f} | {_ms(g['time_s'])}"


def side_by_side(runs: dict, peak, grouping: str, limit: int | None = None) -> list[str]:
    """One row per group: each arch's launches, TFLOP, GB and roofline ms per step, and the first's ms − the last's."""
    from diffjax.aot import profile

    archs = list(runs)
    tables = {a: profile.totals(runs[a]["profile"].kernels, peak, GROUPINGS[grouping]) for a in archs}
    keys = sorted({k for t in tables.values() for k in t},
                  key=lambda k: (-max(t.get(k, {}).get("time_s", 0) for t in tables.values()), k))
    head = f"| {grouping} | " + " | ".join(f"{a} launches | {a} TFLOP | {a} GB | {a} ms" for a in archs) + \
        f" | Δ ms ({archs[0]} − {archs[-1]}) |"
    lines = [head, "|---" * (2 + 4 * len(archs)) + "|"]
    for key in keys[:limit]:
        delta = tables[archs[0]].get(key, {}).get("time_s", 0) - tables[archs[-1]].get(key, {}).get("time_s", 0)
        lines.append(f"| {key} | " + " | ".join(_cells(tables[a].get(key)) for a in archs) + f" | {delta * 1e3:+.2f} |")
    if limit is not None and len(keys) > limit:
        lines.append(f"| … {len(keys) - limit} more (kernels.json) |" + " |" * (1 + 4 * len(archs)))
    return lines


def top_kernels(run: dict, peak, n: int) -> list[str]:
    kernels = sorted(run["profile"].kernels, key=lambda k: -k.launches * k.roofline_s(peak))[:n]
    lines = ["| kernel | kind | category | phase | scope | launches | GFLOP / launch | MB / launch | ms per step | "
             "bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in kernels:
        lines.append(f"| {k.name} | {k.kind} | {k.category} | {k.phase} | {k.scope} | {k.launches} | "
                     f"{k.flops / 1e9:.1f} | {k.bytes / 1e6:.1f} | {_ms(k.launches * k.roofline_s(peak))} | "
                     f"{k.bound(peak)} |")
    return lines


def _op_scope(k) -> str:
    """A kernel's scope · category, every arch's attention op's function named `attention()` so that rows meet."""
    return f"{re.sub(r'[a-z_]*attention[a-z_]*[(][)]', 'attention()', k.scope)} · {k.category}"


def only_in(runs: dict, arch: str, peak, share: float = 0.002) -> list[str]:
    """Scope · category rows of `arch` absent from the baseline (the last arch), or longer by > `share` of its step."""
    from diffjax.aot import profile

    archs = list(runs)
    first, base = (profile.totals(runs[a]["profile"].kernels, peak, _op_scope) for a in (arch, archs[-1]))
    base_step = profile.step_time(runs[archs[-1]]["profile"].kernels, peak)
    deltas = {key: g["time_s"] - base.get(key, {}).get("time_s", 0.0) for key, g in first.items()}
    keys = [key for key, delta in deltas.items() if delta > share * base_step]
    lines = [f"| scope · category | {arch} launches, TFLOP, GB, ms | {archs[-1]} | Δ ms | Δ / {archs[-1]} step |",
             "|---|---|---|---|---|"]
    for key in sorted(keys, key=lambda k: -deltas[k]):
        other, delta = base.get(key), deltas[key]
        lines.append(f"| {key} | {_cells(first[key]).replace(' | ', ', ')} | "
                     f"{_cells(other).replace(' | ', ', ') if other else 'absent'} | {delta * 1e3:+.2f} | "
                     f"{delta / base_step:+.1%} |")
    total = sum(deltas[key] for key in keys)
    lines.append(f"| all of the above | | | {total * 1e3:+.2f} | {total / base_step:+.1%} |")
    return lines


def _attention_s(kernels: list, peak) -> float:
    return sum(k.launches * k.roofline_s(peak) for k in kernels if k.category == "attention")


def calibrate(runs: dict, measured: dict, peak) -> dict | None:
    """The two factors on the roofline times (attention kernels, the rest) that give the first arch's and the
    baseline's measured steps, and each arch's step at them; None if singular or a factor is below 1."""
    from diffjax.aot import profile

    def parts(arch):  # (the rest, attention)
        ks = runs[arch]["profile"].kernels
        return profile.step_time(ks, peak) - _attention_s(ks, peak), _attention_s(ks, peak)

    archs = list(runs)
    (r1, a1), (r2, a2) = parts(archs[0]), parts(archs[-1])
    m1, m2 = measured[f"{archs[0]}_s"], measured[f"{archs[-1]}_s"]
    det = r1 * a2 - r2 * a1
    if abs(det) < 1e-12:
        return None
    rest, attn = (m1 * a2 - m2 * a1) / det, (r1 * m2 - r2 * m1) / det
    if rest < 1 or attn < 1:
        return None
    steps = {a: {"attention_s": parts(a)[1] * attn, "rest_s": parts(a)[0] * rest} for a in archs}
    return {"rest": rest, "attention": attn, "steps": steps}


def summary(runs: dict, chips: list, launch_s: float) -> list[str]:
    from diffjax.aot import profile

    lines = ["| arch | kernels (instructions) | launches | TFLOP (kernels) | TFLOP (model, diffjax.flops) | GB | "
             + " | ".join(f"roofline ms at {c.name} | + launches ms at {c.name}" for c in chips) + " |",
             "|---" * (6 + 2 * len(chips)) + "|"]
    for arch, run in runs.items():
        ks = run["profile"].kernels
        cells = [f"{len(ks):,}", f"{sum(k.launches for k in ks):,}",
                 f"{sum(k.launches * k.flops for k in ks) / 1e12:.2f}", f"{run['model_flops'] / 1e12:.2f}",
                 f"{sum(k.launches * k.bytes for k in ks) / 1e9:.2f}"]
        for c in chips:
            cells += [_ms(profile.step_time(ks, c)), _ms(profile.step_time(ks, c, launch_s))]
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return lines


def ratios(runs: dict, chips: list, launch_s: float) -> dict:
    """{arch: {chip: step time / the baseline's}} at the roofline, with launches, and of attention alone."""
    from diffjax.aot import profile

    archs = list(runs)
    base = runs[archs[-1]]["profile"].kernels
    out = {}
    for a in archs[:-1]:
        ks = runs[a]["profile"].kernels
        out[a] = {c.name: {"roofline": profile.step_time(ks, c) / profile.step_time(base, c),
                           "with_launches": profile.step_time(ks, c, launch_s) / profile.step_time(base, c, launch_s),
                           "attention": _attention_s(ks, c) / (_attention_s(base, c) or float("nan"))}
                  for c in chips}
    return out


def measured_for(args, archs: dict, seq: int) -> dict | None:
    """The H200 measurement of this configuration, if the first arch and the baseline are the ones measured."""
    first, base = archs[next(iter(archs))], archs[list(archs)[-1]]
    if (args.config, args.batch, args.set, first, base) != (MEASURED["config"], MEASURED["batch"], [], ("diff", []),
                                                            ("transformer", [])):
        return None
    return MEASURED["steps"].get(seq)


def against_measurement(runs: dict, measured: dict, seq: int, launch_s: float) -> list[str]:
    """The prediction at the measured chip's peaks beside the measurement, and `calibrate`'s fit."""
    from diffjax.aot import profile

    archs, chip = list(runs), profile.chip(MEASURED["chip"])
    first, base = archs[0], archs[-1]
    at = ratios(runs, [chip], launch_s)[first][chip.name]
    lines = [f"- Measured on one {MEASURED['chip']} (docs/benchmarks.md, device check run 2): {first} / {base} "
             f"**{measured['ratio']:.3f}**; the roofline ratio at {chip.name} is "
             f"{at['roofline'] - measured['ratio']:+.3f} off, {at['with_launches'] - measured['ratio']:+.3f} with "
             f"launches. Attention alone (run 3, 3B head shape, B = 1): {MEASURED['attention_ratio'][seq]:.2f}× "
             f"measured, {at['attention']:.2f}× predicted."]
    for a in (first, base):
        roof = profile.step_time(runs[a]["profile"].kernels, chip)
        lines.append(f"- {a}: measured {measured[f'{a}_s'] * 1e3:.0f} ms per step = {measured[f'{a}_s'] / roof:.2f}× "
                     f"its roofline at {chip.name} ({roof * 1e3:.1f} ms).")
    fit = calibrate(runs, measured, chip)
    if fit:
        steps = fit["steps"]
        gap = measured[f"{first}_s"] - measured[f"{base}_s"]
        attn_gap = steps[first]["attention_s"] - steps[base]["attention_s"]
        lines.append(
            f"- Fitted to the two measured steps (`calibrate`): the attention kernels at {1 / fit['attention']:.0%} of "
            f"{chip.name}'s peak, every other kernel at {fit['rest']:.2f}× its roofline. Attention then takes "
            f"{steps[first]['attention_s'] * 1e3:.0f} ms of {first}'s step and {steps[base]['attention_s'] * 1e3:.0f} "
            f"ms of {base}'s: {attn_gap * 1e3:.0f} ms ({attn_gap / gap:.0%}) of the {gap * 1e3:.0f} ms gap; the other "
            f"kernels {(gap - attn_gap) * 1e3:.0f} ms.")
        base_s = sum(steps[base].values())
        for a in archs[1:-1]:
            step = sum(steps[a].values())
            lines.append(f"- {a} at the fitted factors: {step * 1e3:.0f} ms per step (attention "
                         f"{steps[a]['attention_s'] * 1e3:.0f} ms), **{step / base_s:.3f}**× {base}'s (if its "
                         f"attention kernels reach the same fraction of peak).")
    return lines


def section(args, archs: dict, seq: int, runs: dict, chips: list) -> list[str]:
    peak, launch_s = chips[0], args.launch_us * 1e-6
    labels = list(runs)
    first = runs[labels[0]]
    lines = [f"## T = {seq} × batch {args.batch}", "",
             f"Compiled for {args.target} ({first['devices']} × {first['device_kind']}); kernels: "
             + "; ".join(f"{a} {', '.join(f'{op} → {impl}' for op, impl in r['kernels_used'].items())}"
                         for a, r in runs.items())
             + ". Compile " + ", ".join(f"{a} {r['compile_s']} s" for a, r in runs.items()) + ". Tables at "
             f"{peak.name} ({peak.flops / 1e12:.0f} TFLOP/s bf16 dense, {peak.hbm / 1e12:.2f} TB/s); ms are per step "
             f"per device, at the roofline (launch overhead not included).", ""]
    for a, r in runs.items():
        p = r["profile"]
        if p.unknown_trips or p.conditionals or p.unknown_flops:
            lines.append(f"{a}: loops without a known trip count (counted once): {p.unknown_trips or 'none'}; "
                         f"conditionals (heaviest branch counted): {p.conditionals or 'none'}; custom calls of "
                         f"unknown FLOPs (counted 0): {p.unknown_flops or 'none'}.")
    lines += ["### Step", "", *summary(runs, chips, launch_s), ""]
    for a, per_chip in ratios(runs, chips, launch_s).items():
        for name, r in per_chip.items():
            lines.append(f"- Predicted {a} / {labels[-1]} step time at {name}: **{r['roofline']:.3f}** (roofline), "
                         f"**{r['with_launches']:.3f}** (+ {args.launch_us:g} µs per launch); attention kernels "
                         f"alone {r['attention']:.2f}.")
    measured = measured_for(args, archs, seq)
    if measured:
        lines += against_measurement(runs, measured, seq, launch_s)
    for a in labels[:-1]:
        lines += ["", f"### What {a} has that {labels[-1]} does not (scope · category rows absent there, or longer "
                  f"by > 0.2 % of its step)", "", *only_in(runs, a, peak)]
    lines += ["", "### By category", "", *side_by_side(runs, peak, "category"), "", "### By phase", "",
              *side_by_side(runs, peak, "phase"), "", "### By scope", "",
              *side_by_side(runs, peak, "scope", limit=args.scopes), ""]
    for a, r in runs.items():
        lines += [f"### Top {args.top} kernels: {a}", "", *top_kernels(r, peak, args.top), ""]
    return lines


def header(args, chips: list, wall_s: float) -> list[str]:
    from diffjax.bench.env import cpu_model, versions

    v = versions("jax", "jaxlib")
    with contextlib.suppress(metadata.PackageNotFoundError):  # the XLA:GPU compiler's version
        v["jax-cuda12-plugin"] = metadata.version("jax-cuda12-plugin")
    command = "python experiments/step_profile.py " + " ".join(sys.argv[1:])
    return ["# Step profile: " + " vs ".join(parse_archs(args.archs)), "",
            f"`{command}` — {args.config}, target {args.target}, deviceless on {cpu_model()}; "
            + ", ".join(f"{k} {val}" for k, val in v.items()) + f"; {wall_s:.0f} s in all.", "",
            "Peaks: " + "; ".join(f"{c.name} ({c.kind}) {c.flops / 1e12:.0f} TFLOP/s, {c.hbm / 1e12:.2f} TB/s"
                                  for c in chips)
            + " (diffjax.train.metrics.PEAK_FLOPS, diffjax.aot.profile.HBM_BANDWIDTH: datasheets). FLOPs: dots, "
            "convolutions and attention custom calls (elementwise not counted); bytes: each kernel's operands and "
            "results at its HBM boundary; roofline = max(FLOPs / peak, bytes / bandwidth) per launch, launches = "
            "the product of the enclosing loops' trip counts (diffjax/aot/profile.py).", ""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=MEASURED["config"], help="config spec; arch= is set per arch")
    p.add_argument("--archs", default="diff,transformer",
                   help="comma-separated, each ARCH or ARCH:KEY=VALUE+KEY=VALUE; the last is the baseline")
    p.add_argument("--seq-lens", default="2048,4096")
    p.add_argument("--batch", type=int, default=4, help="data.batch_size (the global batch)")
    p.add_argument("--target", default="h100x1")
    p.add_argument("--chips", default="h200,h100", help="peaks to evaluate at (the first in the tables)")
    p.add_argument("--launch-us", type=float, default=3.0, help="overhead per kernel launch, microseconds")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--scopes", type=int, default=40, help="rows of the scope table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--reuse", action="store_true", help="read the HLO kept in --out instead of compiling")
    args = p.parse_args(argv)

    from diffjax import host
    from diffjax.aot import profile, targets
    from diffjax.config import ConfigError

    try:
        chips = [profile.chip(c) for c in args.chips.split(",")]
        seqs = [int(s) for s in args.seq_lens.split(",")]
        archs = parse_archs(args.archs)
    except ValueError as e:
        p.error(str(e))
    host.cpu_only()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    body, dump = [], {}
    try:
        for seq in seqs:
            runs = {}
            for label, (arch, overrides) in archs.items():
                name = re.sub(r"[^\w.\-]+", "_", label).strip("_")
                hlo_path, meta_path = out / f"{name}_T{seq}.hlo.txt", out / f"{name}_T{seq}.json"
                if args.reuse and hlo_path.exists() and meta_path.exists():
                    run = json.loads(meta_path.read_text()) | {"hlo": hlo_path.read_text()}
                else:
                    print(f"compiling {label} T={seq} for {args.target} ...", file=sys.stderr, flush=True)
                    run = compile_hlo(args.config, arch, seq, args.batch, [*args.set, *overrides], args.target)
                    hlo_path.write_text(run["hlo"])
                    meta_path.write_text(json.dumps({k: v for k, v in run.items() if k != "hlo"}, indent=1))
                run["profile"] = profile.profile(run.pop("hlo"))
                runs[label] = run
            body += section(args, archs, seq, runs, chips)
            dump[seq] = {"ratios": ratios(runs, chips, args.launch_us * 1e-6),
                         "kernels": {a: [dataclasses.asdict(k) for k in r["profile"].kernels] for a, r in runs.items()}}
    except (ConfigError, targets.TargetUnavailable) as e:  # a bad config or target; a host without its compiler
        print(f"step_profile.py: error: {e}", file=sys.stderr)
        return 2
    report = "\n".join(header(args, chips, time.perf_counter() - start) + body)
    (out / "report.md").write_text(report)
    (out / "kernels.json").write_text(json.dumps(dump, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One command on a GPU or TPU host: are the kernels right there, how fast are they, and does a model train?

    python experiments/device_check.py --out runs/device_check       # `make device-check`; under 10 minutes
    python experiments/device_check.py --smoke --out /tmp/dc           # the same code path, tiny shapes, on CPU

Sections (each recorded as ok / failed / error, or skipped with the reason where the platform cannot run it):
  conformance   the fused DIFF kernel and every kernel "auto" would use on this platform (its choice and its
                fallbacks, `kernels.candidates`) against the float32 XLA reference, forward and the gradients of
                q1, q2, k1, k2, v, λ (q, k, v for the standard op): causal, with and without segment ids, GQA,
                bf16 and float32 (`diffjax.kernels.conformance`, the comparison tests/test_kernels.py runs on CPU).
  attention     fused DIFF attention vs the platform's standard fused attention (cuDNN through
                `jax.nn.dot_product_attention` on a GPU) with 2h heads, forward+backward, causal bf16, at the
                3B model's head shape (configs/paper.py:size=3B), T = 2K/4K/8K: interleaved rounds in one process,
                the ratio as the median of per-round ratios (diffjax/bench/attention.py's timing).
  train_step    the train step, DIFF vs its parameter-matched Transformer at configs/paper.py:size=1.4B, T = 2K and
                4K: tokens/s and MFU (diffjax/bench/train.py's interleaved comparison; MFU null where the
                device's peak is unknown, diffjax/train/metrics.py).
  training_run  ~50 steps of configs/small.py:size=small through the project's train loop; passes when the loss
                goes down (mean of the last fifth of the logged losses below that of the first fifth).

Writes device_check.json and device_check.md (Markdown ready for docs/benchmarks.md: device, versions, command) in
--out. --smoke runs every section's code with tiny shapes (Pallas in interpret mode where there is no GPU/TPU) and is
a test of this script, not a measurement. Exit status: 0 when every section that ran passed, 1 when one did not,
2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import config as config_lib
from diffjax import kernels, sharding
from diffjax.bench.attention import FLOP_UNITS, inputs, is_oom, step_fn, time_interleaved
from diffjax.bench.env import cpu_model, versions
from diffjax.bench.train import BASELINE, compare, with_arch
from diffjax.kernels import conformance
from diffjax.kernels.conformance import Case
from diffjax.train import loop
from diffjax.train import metrics as metrics_lib

SECTIONS = ("conformance", "attention", "train_step", "training_run")
DTYPES = ("bfloat16", "float32")
# Norm-relative tolerances on the device: (forward, gradients). bf16 as on CPU (conformance.TOLERANCES: bf16 rounding
# of the output and of P before the P·V and dS·K products, ≤ 4e-3 / 7e-3 measured, independent of T). float32: the
# CPU maxima were ≤ 8e-7 at S ≤ 256; rounding errors of S-term sums grow like √S, so ≤ ~2e-6 at the S = 1024 used
# here, and the tolerance leaves 10× on top for the GPU's exp2 approximation and summation order. A real fault —
# a wrong mask, λ's sign, a missing GQA group sum — gives errors of order 0.1-1.
DEVICE_TOLERANCES = {"float32": (2e-5, 5e-5), "bfloat16": (1e-2, 2e-2)}


def _cases(b: int, t: int, h: int, k: int, d: int, ragged_t: int) -> list[Case]:
    """Causal GQA with and without packed documents, and a ragged length with one kv head (MQA), per dtype."""
    cases = []
    for dt in DTYPES:
        tag = "bf16" if dt == "bfloat16" else "f32"
        cases += [Case(f"{tag}_causal_gqa", b, t, h, k, d, dt, True),
                  Case(f"{tag}_causal_gqa_segments", b, t, h, k, d, dt, True, segments=True),
                  Case(f"{tag}_causal_ragged{ragged_t}_mqa", 1, ragged_t, h, 1, d, dt, True)]
    return cases


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes and counts of one run: FULL on a device, SMOKE anywhere."""

    cases: list[Case]
    attention_config: str  # its DIFF model's head shape (the baseline: the same spec with arch=transformer)
    attention_seqs: tuple[int, ...]
    attention_warmup: int
    attention_reps: int
    train_config: str
    train_seqs: tuple[int, ...]
    train_batch_per_device: int
    train_warmup: int
    train_steps: int
    train_overrides: tuple[str, ...]
    run_config: str
    run_steps: int
    run_overrides: tuple[str, ...]


FULL = Plan(
    cases=_cases(2, 1024, 8, 2, 128, ragged_t=1000),
    attention_config="configs/paper.py:size=3B", attention_seqs=(2048, 4096, 8192), attention_warmup=3,
    attention_reps=20,
    train_config="configs/paper.py:size=1.4B", train_seqs=(2048, 4096), train_batch_per_device=4, train_warmup=2,
    train_steps=10, train_overrides=(),
    run_config="configs/small.py:size=small,arch=diff", run_steps=50,
    # bf16: what an accelerator trains in, so the run goes through the fused kernel's bf16 path
    run_overrides=("model.dtype=bfloat16", "optim.warmup_steps=10"),
)
SMOKE = Plan(
    cases=[c for c in _cases(1, 32, 2, 1, 16, ragged_t=40) if "ragged" not in c.name],
    attention_config="configs/small.py:size=tiny", attention_seqs=(128,), attention_warmup=1, attention_reps=3,
    train_config="configs/small.py:size=tiny", train_seqs=(32,), train_batch_per_device=2, train_warmup=1,
    train_steps=2, train_overrides=(),
    run_config="configs/small.py:size=tiny,arch=diff", run_steps=20,
    run_overrides=("data.seq_len=64", "data.batch_size=8", "data.tasks=mqar", "data.mqar_pairs=6",
                   "data.mqar_queries=6", "optim.warmup_steps=2"),
)


class BadInput(Exception):
    """Bad command-line input: one line, exit status 2."""


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"


# ------------------------------------------------------------------------------------------------ conformance


def conformance_targets(platform: str) -> tuple[list[tuple[str, str, bool]], list[dict]]:
    """([(op, impl, interpret)], skipped entries) checked on `platform`: the fused DIFF kernel first, then the rest of
    what "auto" would try for each op. Without a GPU or TPU the fused kernel is the Triton one in interpret mode, and
    "auto" has nothing but the oracle itself."""
    fused = ("diff_attention", "pallas", False) if platform in ("gpu", "tpu") else ("diff_attention", "pallas_gpu",
                                                                                   True)
    targets, skipped = [fused], []
    for op in ("diff_attention", "attention"):
        for dtype in DTYPES:
            names = kernels.candidates(op, platform, dtype)
            if names == ["xla"]:
                skipped.append(dict(op=op, impl="xla", dtype=dtype, status="skipped",
                                    reason=f'"auto" picks xla for {op} in {dtype} on {platform}: the oracle itself'))
            for name in names[:-1]:
                if (op, name, False) not in targets:
                    targets.append((op, name, False))
    return targets, skipped


def check_target(op: str, impl: str, interpret: bool, case: Case, platform: str) -> dict:
    """One conformance entry: the comparison's result, or why it was skipped or could not run."""
    entry = dict(op=op, impl=impl, interpret=interpret, case=dataclasses.asdict(case), dtype=case.dtype)
    if not (interpret or impl in kernels.candidates(op, platform, case.dtype)):
        return entry | dict(status="skipped", reason=f'"auto" does not use {impl} for {case.dtype} on {platform}')
    seed = zlib.crc32(f"{op}/{impl}/{case.name}".encode())
    t0 = time.perf_counter()
    try:
        if op == "diff_attention":
            fn = functools.partial(kernels.diff_attention, impl=impl, interpret=interpret)
            result = conformance.check_diff(fn, case, seed, DEVICE_TOLERANCES)
        else:
            fn = functools.partial(kernels.attention, impl=impl, interpret=interpret)
            result = conformance.check_attention(fn, case, seed, DEVICE_TOLERANCES)
    except Exception as err:  # noqa: BLE001  a kernel that cannot run here is a failed entry, not the end
        return entry | dict(status="error", error=_error(err), seconds=time.perf_counter() - t0)
    return entry | result | dict(status="passed" if result["passed"] else "failed", seconds=time.perf_counter() - t0)


def conformance_section(plan: Plan, platform: str) -> dict:
    targets, skipped = conformance_targets(platform)
    results = []
    # float32 inputs mean float32 matmuls, here as in the tests' conftest: the Pallas kernels ask for it themselves;
    # JAX's TPU flash attention (the standard op on TPU) follows this setting.
    with jax.default_matmul_precision("highest"):
        for op, impl, interpret in targets:
            for case in plan.cases:
                entry = check_target(op, impl, interpret, case, platform)
                results.append(entry)
                print(f"  conformance {op} {impl}{' (interpret)' if interpret else ''} {case.name}: "
                      f"{entry['status']} {_entry_summary(entry)}", flush=True)
    ran = [r for r in results if r["status"] != "skipped"]
    status = "ok" if ran and all(r["status"] == "passed" for r in ran) else "failed"
    return dict(status=status, tolerances=DEVICE_TOLERANCES, results=results, skipped=skipped)


def _entry_summary(entry: dict) -> str:
    if entry["status"] == "error":
        return entry["error"]
    if entry["status"] == "skipped":
        return entry["reason"]
    return f"out {entry['errors']['out']:.2e}, worst gradient {entry['worst_grad']} {entry['max_grad_error']:.2e}"


# -------------------------------------------------------------------------------------------------- attention


def per_round_ratio(a: list[float], b: list[float]) -> dict:
    """The median (p10, p90) of the per-round ratios a[i] / b[i] of two interleaved timings (each round runs both back
    to back, so drift in load or clocks cancels)."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return dict(median=statistics.median(ratios), p10=float(np.percentile(ratios, 10)),
                p90=float(np.percentile(ratios, 90)))


def attention_section(plan: Plan, platform: str) -> dict:
    """"diff": auto's DIFF kernel; "fallback": the next one auto would take (cuDNN's composition on a GPU), whose time
    against "diff" is what auto's fixed order should follow (docs/kernels.md); "standard": auto's standard attention
    with 2h heads."""
    diff_names = kernels.candidates("diff_attention", platform, "bfloat16")[:-1]  # without the xla reference
    base = kernels.choice("auto", "attention", platform, "bfloat16")
    if not diff_names or base == "xla":
        return dict(status="skipped", reason=f"no fused attention kernels on {platform} (\"auto\" picks "
                                             f"{(diff_names or ['xla'])[0]} for DIFF and {base} for standard "
                                             "attention; cuDNN needs a GPU)")
    diff_model = config_lib.load(with_arch(plan.attention_config, "diff")).model
    base_model = config_lib.load(with_arch(plan.attention_config, BASELINE)).model
    h, d = diff_model.n_heads, diff_model.head_dim
    if base_model.n_heads != 2 * h or base_model.head_dim != d:
        raise RuntimeError(f"{plan.attention_config}: the baseline has {base_model.n_heads} heads of "
                           f"{base_model.head_dim}, not 2h = {2 * h} of {d}")
    rows = {"diff": ("diff", diff_names[0], "diff_attention")}  # key: (input kind, impl, op)
    if len(diff_names) > 1:
        rows["fallback"] = ("diff", diff_names[1], "diff_attention")
    rows["standard"] = ("standard", base, "attention")
    batch, cells = 1, []
    for seq in plan.attention_seqs:
        cell = dict(seq=seq, batch=batch)
        try:
            calls = []
            for kind, impl, op in rows.values():
                args, ct = inputs(kind, batch, seq, h, d, jnp.bfloat16)
                calls.append((step_fn(functools.partial(kernels.resolve(impl, op), causal=True), "fwd+bwd", ct), args))
            times = dict(zip(rows, time_interleaved(calls, plan.attention_warmup, plan.attention_reps), strict=True))
        except Exception as err:  # noqa: BLE001  one failed length must not end the section
            cells.append(cell | dict(status="OOM" if is_oom(err) else "error", error=_error(err)))
            print(f"  attention T={seq}: {cells[-1]['status']} {cells[-1]['error']}", flush=True)
            continue
        for key, (kind, impl, _) in rows.items():
            flops = FLOP_UNITS[kind]["fwd+bwd"] * h * seq * seq * d * batch / 2  # causal halves
            cell[key] = dict(impl=impl, ms=1e3 * statistics.median(times[key]), times_s=times[key],
                             tflops=flops / statistics.median(times[key]) / 1e12)
        cell["ratio"] = per_round_ratio(times["diff"], times["standard"])
        if "fallback" in rows:
            cell["fallback_ratio"] = per_round_ratio(times["fallback"], times["standard"])
            cell["diff_vs_fallback"] = per_round_ratio(times["diff"], times["fallback"])
        cell["status"] = "ok"
        cells.append(cell)
        print(f"  attention T={seq}: " + ", ".join(f"{k} ({cell[k]['impl']}) {cell[k]['ms']:.3f} ms" for k in rows)
              + f"; DIFF / standard {cell['ratio']['median']:.3f}", flush=True)
    status = "ok" if all(c["status"] == "ok" for c in cells) else "failed"
    return dict(status=status, config=plan.attention_config, impls={k: v[1] for k, v in rows.items()},
                diff_heads=h, standard_heads=2 * h, head_dim=d, v_head_dim=2 * d, batch=batch, dtype="bfloat16",
                causal=True, mode="fwd+bwd", warmup=plan.attention_warmup, reps=plan.attention_reps,
                flop_units=FLOP_UNITS, cells=cells)


# ------------------------------------------------------------------------------------------------- train step


def train_step_section(plan: Plan, platform: str) -> dict:
    del platform
    peak = metrics_lib.peak_flops_per_device(jax.devices()[0])
    batch = plan.train_batch_per_device * jax.device_count()
    results = []
    for seq in plan.train_seqs:
        overrides = [*plan.train_overrides, f"data.seq_len={seq}", f"data.batch_size={batch}"]
        try:
            diff_cfg = config_lib.load(with_arch(plan.train_config, "diff"), overrides)
            base_cfg = config_lib.load(with_arch(plan.train_config, BASELINE), overrides)
            print(f"  train step T={seq}, batch {batch}", flush=True)
            result = compare(diff_cfg, base_cfg, sharding.make_mesh(diff_cfg.mesh), plan.train_steps,
                             plan.train_warmup, peak)
        except Exception as err:  # noqa: BLE001
            results.append(dict(seq_len=seq, batch=batch, status="OOM" if is_oom(err) else "error",
                                error=_error(err)))
            print(f"  train step T={seq}: {results[-1]['status']} {results[-1]['error']}", flush=True)
            continue
        results.append(result | dict(status="ok"))
    status = "ok" if all(r["status"] == "ok" for r in results) else "failed"
    return dict(status=status, config=plan.train_config, overrides=list(plan.train_overrides),
                warmup=plan.train_warmup, steps=plan.train_steps, peak_flops=peak, results=results)


# ----------------------------------------------------------------------------------------------- training run


def training_run_section(plan: Plan, platform: str, out: Path) -> dict:
    del platform
    n = plan.run_steps
    overrides = [f"train.steps={n}", "train.log_every=1", f"train.eval_every={n}", f"train.checkpoint_every={n}",
                 "train.eval_batches=1", "train.telemetry_every=0", *plan.run_overrides]
    cfg = config_lib.load(plan.run_config, overrides)
    # a fresh directory per check (never one an earlier check, or anyone else, left there)
    workdir = Path(tempfile.mkdtemp(prefix="training_run-", dir=out))
    t0 = time.perf_counter()
    result = loop.train(cfg, workdir, progress=False)
    seconds = time.perf_counter() - t0
    losses = {r["step"]: r["loss"] for r in metrics_lib.read_metrics(workdir) if r["split"] == "train"}
    steps = sorted(losses)
    k = max(1, len(steps) // 5)
    first, last = statistics.fmean(losses[s] for s in steps[:k]), statistics.fmean(losses[s] for s in steps[-k:])
    went_down = math.isfinite(last) and last < first
    print(f"  training run: {len(steps)} steps, loss {first:.4f} (first {k}) -> {last:.4f} (last {k})", flush=True)
    return dict(status="ok" if went_down else "failed", config=plan.run_config, overrides=overrides,
                model=dict(arch=cfg.model.arch, dtype=cfg.model.dtype, d_model=cfg.model.d_model,
                           n_layers=cfg.model.n_layers, attention_impl=cfg.model.attention_impl,
                           attention_kernel=kernels.choice(cfg.model.attention_impl, "diff_attention",
                                                           kernels.platform(), cfg.model.dtype)),
                steps=result.step, seconds=seconds, losses=[losses[s] for s in steps], window=k,
                first_loss=first, last_loss=last, loss_went_down=went_down,
                tokens_per_s=(result.train or {}).get("tokens_per_s"),
                val_loss=(result.val or {}).get("loss"), workdir=str(workdir))


# ---------------------------------------------------------------------------------------------------- report


def _jsonable(x):
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(report: dict) -> str:
    meta, sec = report["meta"], report["sections"]
    dev = meta["device"]
    lines = [f"## Device check: {dev['kind']}", ""]
    if meta["smoke"]:
        lines += ["**SMOKE RUN** (`--smoke`: tiny shapes; a test of the script, not a measurement).", ""]
    cc = f", compute capability {dev['compute_capability']}" if dev.get("compute_capability") else ""
    lines += [f"Command: `{meta['command']}` ({meta['started']}, {meta['wall_s']:.0f} s in all). "
              f"Device: {dev['kind']} ({dev['platform']} × {dev['count']}{cc}), host CPU {dev['cpu']}. "
              "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ". "
              f"Result: **{'passed' if report['passed'] else 'FAILED'}**.", ""]

    def head(title: str, s: dict) -> None:
        lines.extend([f"### {title}", ""])
        if s["status"] == "skipped":
            lines.extend([f"Skipped: {s['reason']}.", ""])
        elif s["status"] == "error":
            lines.extend([f"Error: `{s['error']}`.", ""])

    s = sec.get("conformance")
    if s:
        head("Kernel conformance (against the float32 XLA reference)", s)
        if "results" in s:
            lines += ["Norm-relative errors ‖x − ref‖/‖ref‖ of the output and of the worst gradient (q1, q2, k1, k2, "
                      "v, λ; q, k, v for the standard op); every case causal. Case: B × T, H query heads / K kv heads, "
                      "head dim d.", "",
                      "| kernel | op | case | B × T, H/K, d | dtype | out | worst gradient | tolerance out / grads "
                      "| result |", "|---|---|---|---|---|---|---|---|---|"]
            for r in s["results"]:
                c = r["case"]
                shape = f"{c['b']} × {c['t']}, {c['h']}/{c['k']}, {c['d']}" + (", segments" if c["segments"] else "")
                kernel = r["impl"] + (" (interpret)" if r["interpret"] else "")
                if r["status"] in ("passed", "failed"):
                    tol = f"{r['tolerance']['forward']:.0e} / {r['tolerance']['gradients']:.0e}"
                    lines.append(f"| {kernel} | {r['op']} | {c['name']} | {shape} | {r['dtype']} | "
                                 f"{_f(r['errors']['out'], '.1e')} | {r['worst_grad']} "
                                 f"{_f(r['max_grad_error'], '.1e')} | {tol} | {r['status']} |")
                else:
                    why = r.get("reason") or f"`{r.get('error')}`"
                    lines.append(f"| {kernel} | {r['op']} | {c['name']} | {shape} | {r['dtype']} | | | | "
                                 f"{r['status']}: {why} |")
            lines.append("")
            lines += [f"Skipped: {k['reason']}." for k in s["skipped"]]
            lines.append("")

    s = sec.get("attention")
    if s:
        head("Attention: fused DIFF vs standard, forward+backward, causal bf16", s)
        if "cells" in s:
            impls = s["impls"]
            fb = "fallback" in impls
            lines += [f"{s['config']}: DIFF {s['diff_heads']} heads of d = {s['head_dim']} (V {s['v_head_dim']}) on "
                      f"`{impls['diff']}`" + (f" (and `auto`'s fallback, `{impls['fallback']}`)" if fb else "") +
                      f" vs standard attention with {s['standard_heads']} heads of {s['head_dim']} on "
                      f"`{impls['standard']}`, B = {s['batch']}. {s['reps']} interleaved rounds after {s['warmup']} "
                      "warm-up; times are medians, ratios the median of the per-round ratios (p10–p90). TFLOP/s: "
                      "algorithmic counts (DIFF 32, standard 28 units of h·N²·d, halved for causal).", ""]
            cols = [f"DIFF `{impls['diff']}` ms"] + ([f"DIFF `{impls['fallback']}` ms"] if fb else []) + \
                [f"standard `{impls['standard']}` ms", f"`{impls['diff']}` DIFF / standard"] + \
                ([f"`{impls['fallback']}` DIFF / standard", f"`{impls['diff']}` / `{impls['fallback']}` DIFF"]
                 if fb else []) + ["TFLOP/s " + ", ".join(impls.values())]
            lines += ["| T | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            ratio = lambda r: f"**{r['median']:.3f}** ({r['p10']:.3f}–{r['p90']:.3f})"  # noqa: E731
            for c in s["cells"]:
                if c["status"] != "ok":
                    lines.append(f"| {c['seq']} | {c['status']}: `{c['error']}` |" + " |" * (len(cols) - 1))
                    continue
                vals = [f"{c[k]['ms']:.3f}" for k in impls] + [ratio(c["ratio"])]
                vals += [ratio(c["fallback_ratio"]), ratio(c["diff_vs_fallback"])] if fb else []
                vals.append(", ".join(f"{c[k]['tflops']:.1f}" for k in impls))
                lines.append(f"| {c['seq']} | " + " | ".join(vals) + " |")
            lines.append("")

    s = sec.get("train_step")
    if s:
        head("Train step: DIFF vs Transformer", s)
        if "results" in s:
            peak = "unknown (MFU n/a)" if s["peak_flops"] is None else f"{s['peak_flops'] / 1e12:.0f} TFLOP/s"
            lines += [f"{s['config']} (DIFF, and the same spec with arch=transformer: 2h heads of d), AdamW step "
                      f"included; {s['steps']} timed steps per model in interleaved rounds after {s['warmup']} "
                      f"warm-up. Peak per device: {peak}. MFU = algorithmic training FLOPs (`diffjax.flops`) × "
                      "tokens/s / peak.", "",
                      "| T × batch | model | params | median step s | tokens/s | TFLOP/s | MFU |",
                      "|---|---|---|---|---|---|---|"]
            ratios = []
            for r in s["results"]:
                if r["status"] != "ok":
                    lines.append(f"| {r['seq_len']} × {r['batch']} | {r['status']}: `{r['error']}` | | | | | |")
                    continue
                for name, m in r["models"].items():
                    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
                    lines.append(f"| {r['seq_len']} × {r['batch']} | {name} | {m['params']:,} | {m['median_s']:.4f} "
                                 f"| {m['tokens_per_s']:,.0f} | {m['tflops_per_s']:.1f} | {mfu} |")
                ratios.append(f"T = {r['seq_len']}: **{r['step_time_ratio_paired_median']:.3f}** (p10–p90 "
                              f"{r['step_time_ratio_paired_p10']:.3f}–{r['step_time_ratio_paired_p90']:.3f}; FLOP "
                              f"ratio {r['flop_ratio']:.3f})")
            lines += ["", "DIFF / Transformer step time, median of per-round ratios: " + "; ".join(ratios) + ".", ""]

    s = sec.get("training_run")
    if s:
        head("Training run", s)
        if "losses" in s:
            m = s["model"]
            lines += [f"`{s['config']}` with {', '.join(s['overrides'])}: {m['arch']}, d_model {m['d_model']}, "
                      f"{m['n_layers']} layers, {m['dtype']}, attention `{m['attention_kernel']}`.", "",
                      "| steps | loss, mean of first steps | loss, mean of last steps | went down | val loss "
                      "| tokens/s | seconds |", "|---|---|---|---|---|---|---|",
                      f"| {s['steps']} | {s['first_loss']:.4f} (first {s['window']}) | {s['last_loss']:.4f} "
                      f"(last {s['window']}) | {'yes' if s['loss_went_down'] else 'NO'} | {_f(s['val_loss'], '.4f')} | "
                      f"{_f(s['tokens_per_s'], ',.0f')} | {s['seconds']:.1f} |", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- main


def _device_info() -> dict:
    device = jax.devices()[0]
    return dict(kind=device.device_kind, platform=jax.default_backend(), count=jax.device_count(),
                compute_capability=getattr(device, "compute_capability", None), cpu=cpu_model(),
                cpu_count=len(os.sched_getaffinity(0)))


def run(sections, plan: Plan, out: Path, smoke: bool, command: str) -> dict:
    platform = kernels.normalize_platform(jax.default_backend())
    meta = dict(device=_device_info(), versions=versions("jax", "jaxlib", "flax", "optax", "numpy"),
                command=command, smoke=smoke, sections=list(sections),
                started=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    print(f"device check on {meta['device']['kind']} ({platform} × {meta['device']['count']})"
          f"{' — SMOKE RUN' if smoke else ''}", flush=True)
    runners = {"conformance": lambda: conformance_section(plan, platform),
               "attention": lambda: attention_section(plan, platform),
               "train_step": lambda: train_step_section(plan, platform),
               "training_run": lambda: training_run_section(plan, platform, out)}
    results, t_start = {}, time.perf_counter()
    for name in sections:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = runners[name]()
        except Exception as err:  # noqa: BLE001  a broken section is reported; the others still run
            traceback.print_exc()
            results[name] = dict(status="error", error=_error(err))
        results[name]["seconds"] = time.perf_counter() - t0
        print(f"   {name}: {results[name]['status']} ({results[name]['seconds']:.1f} s)", flush=True)
    meta["wall_s"] = time.perf_counter() - t_start
    passed = all(s["status"] in ("ok", "skipped") for s in results.values())
    return dict(meta=meta, passed=passed, sections=results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/device_check", help="directory for device_check.json and .md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: test the script anywhere, in seconds")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="run only these sections (default: all)")
    args = parser.parse_args(argv)
    try:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise BadInput(f"--out {args.out}: exists and is not a directory")
        if jax.default_backend() not in ("gpu", "tpu") and not args.smoke:
            raise BadInput(f"no GPU or TPU here (jax backend {jax.default_backend()!r}): the device check needs one; "
                           "--smoke runs its code path with tiny shapes on a CPU")
        out.mkdir(parents=True, exist_ok=True)
    except (BadInput, OSError) as err:
        print(f"device_check: {err}", file=sys.stderr)
        return 2
    command = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else \
        " ".join(["python", "experiments/device_check.py", *argv])
    sections = [s for s in SECTIONS if s in args.sections]
    report = _jsonable(run(sections, SMOKE if args.smoke else FULL, out, args.smoke, command))
    (out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "device_check.md").write_text(markdown(report) + "\n")
    print(f"wrote {out / 'device_check.json'} and {out / 'device_check.md'}: "
          f"{'passed' if report['passed'] else 'FAILED'} in {report['meta']['wall_s']:.0f} s", flush=True)
    return 0 if report["passed"] else 1

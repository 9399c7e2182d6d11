"""Attention benchmark at the 3B shape (docs/design.md §4): fused DIFF vs the cuDNN composition vs XLA vs standard.

    python experiments/bench_attention.py                       # GPU: seq 2K/4K/8K/32K, causal, bf16
    python experiments/bench_attention.py --json out.json --seq 4096 8192 --impls pallas cudnn_std
    python experiments/bench_attention.py --interpret --small   # CPU smoke run: proves the script works

Cells: forward and forward+backward (one jitted vjp) per implementation and sequence length; median wall
time of --iters timed calls after --warmup calls, each bracketed by `jax.block_until_ready`. TFLOP/s use the
algorithmic counts of docs/design.md §4 in units of h·N²·d (h = DIFF heads, halved for causal): standard attention
(2h heads of d) forward 8, backward 20; DIFF forward 12, backward 20 — the same counts for every DIFF impl,
so TFLOP/s compare time. `ratio` = time(impl) / time(cudnn_std). Out-of-memory cells are reported, not fatal.

Numbers from --interpret/--small or a CPU backend are smoke-test output, not kernel performance.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from diffjax import kernels
from diffjax.kernels import cudnn

# 3B model (paper Table 9): DIFF 12 heads of d = 128 (V 256); Transformer 24 heads of 128.
FULL = dict(batch=1, heads=12, head_dim=128, seqs=(2048, 4096, 8192, 32768))
SMALL = dict(batch=1, heads=2, head_dim=64, seqs=(128, 256))
IMPLS = ("pallas", "cudnn", "xla", "cudnn_std")
FLOP_UNITS = {"diff": {"fwd": 12, "fwd+bwd": 32}, "standard": {"fwd": 8, "fwd+bwd": 28}}


def _resolve(impl: str, interpret: bool):
    """(function, path) for one row: the kernel registry's function for `impl`, and where it is not what the
    row's name says, the path that actually runs (None when it is).

    `cudnn_std` is the registry's cuDNN `attention` op. cuDNN needs a GPU; elsewhere the `cudnn` row runs the
    same four-call composition through jax.nn's XLA path and `cudnn_std` the registry's `xla` attention, so a
    CPU smoke run covers every row. `interpret` only reaches the Pallas impls.
    """
    op, name = ("attention", "cudnn") if impl == "cudnn_std" else ("diff_attention", impl)
    if name == "cudnn" and jax.default_backend() != "gpu":
        if op == "attention":
            return functools.partial(kernels.resolve("xla", op), causal=True), "xla"
        return functools.partial(cudnn.diff_attention, causal=True, implementation="xla"), "xla-fallback"
    interpret = interpret and name.startswith("pallas")
    return functools.partial(kernels.resolve(name, op, interpret=interpret), causal=True, interpret=interpret), None


def inputs(kind: str, batch: int, seq: int, heads: int, d: int, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seq), 6)
    if kind == "diff":
        q1, q2, k1, k2 = (jax.random.normal(k, (batch, seq, heads, d), dtype) for k in keys[:4])
        v = jax.random.normal(keys[4], (batch, seq, heads, 2 * d), dtype)
        args = (q1, q2, k1, k2, v, jnp.float32(0.8))
        ct = jax.random.normal(keys[5], (batch, seq, heads, 2 * d), dtype)
    else:
        q, k, v = (jax.random.normal(k, (batch, seq, 2 * heads, d), dtype) for k in keys[:3])
        args = (q, k, v)
        ct = jax.random.normal(keys[5], (batch, seq, 2 * heads, d), dtype)
    return args, ct


def _time(fn, args, warmup: int, iters: int) -> float:
    """Median milliseconds of `iters` calls after `warmup` (the first also compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def step_fn(fn, mode: str, ct):
    """What one cell times, jitted: the forward ("fwd"), or forward+backward ("fwd+bwd": one vjp, every input's
    gradient for the cotangent `ct`)."""
    return jax.jit(fn) if mode == "fwd" else jax.jit(lambda *a: jax.vjp(fn, *a)[1](ct))


def time_interleaved(calls, warmup: int, reps: int) -> list[list[float]]:
    """Seconds per call of each `(fn, args)` in `calls`, run side by side: after `warmup` untimed rounds (the first
    compiles), `reps` rounds each calling every fn once (alternating the order, so that drift in the machine's load
    or clocks hits all alike), each call bracketed by `jax.block_until_ready`. Returns one list per call."""
    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for r in range(reps):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            fn, args = calls[i]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return times


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OOM" in text


def bench_cell(impl: str, seq: int, mode: str, cfg: dict, dtype, interpret: bool, warmup: int, iters: int):
    kind = "standard" if impl == "cudnn_std" else "diff"
    h, d = cfg["heads"], cfg["head_dim"]
    cell = dict(impl=impl, seq=seq, mode=mode, kind=kind, batch=cfg["batch"], heads=h, head_dim=d)
    try:
        fn, path = _resolve(impl, interpret)
        if path is not None:
            cell["path"] = path  # not what the row's name says (no GPU): see _resolve
        args, ct = inputs(kind, cfg["batch"], seq, h, d, dtype)
        ms = _time(step_fn(fn, mode, ct), args, warmup, iters)
    except Exception as err:  # noqa: BLE001  one failed cell must not end the sweep
        cell.update(status="OOM" if is_oom(err) else "error", error=f"{type(err).__name__}: {str(err)[:300]}")
        return cell
    flops = FLOP_UNITS[kind][mode] * h * seq * seq * d * cfg["batch"] / 2  # causal halves
    cell.update(status="ok", ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    return cell


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 2K 4K 8K 32K; small: 128 256)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--interpret", action="store_true", help="run Pallas kernels in interpret mode (CPU)")
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    parser.add_argument("--json", help="write every figure to this path")
    args = parser.parse_args(argv)

    cfg = dict(SMALL if args.small else FULL)
    seqs = args.seq or cfg["seqs"]
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    smoke = args.interpret or args.small or jax.default_backend() == "cpu"
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, dtype {args.dtype}, "
          f"B={cfg['batch']} DIFF h={cfg['heads']} d={cfg['head_dim']} / standard {2 * cfg['heads']} heads")
    if smoke:
        print("SMOKE RUN (interpret/small/CPU): timings below are not kernel performance.")
    if jax.default_backend() != "gpu":
        print("no GPU: [xla-fallback] cudnn runs its composition through jax.nn's XLA path; "
              "[xla] cudnn_std runs the xla impl (ratio is vs that)")

    cells = []
    for seq in seqs:
        for mode in args.modes:
            for impl in args.impls:
                cell = bench_cell(impl, seq, mode, cfg, dtype, args.interpret, args.warmup, args.iters)
                cells.append(cell)
    base = {(c["seq"], c["mode"]): c["ms"] for c in cells if c["impl"] == "cudnn_std" and c["status"] == "ok"}
    for c in cells:
        if c["status"] == "ok" and (c["seq"], c["mode"]) in base:
            c["ratio_vs_standard"] = c["ms"] / base[(c["seq"], c["mode"])]

    print(f"{'seq':>6} {'mode':>8} {'impl':>10} {'ms':>10} {'TFLOP/s':>8} {'ratio':>6}")
    for c in cells:
        if c["status"] != "ok":
            print(f"{c['seq']:>6} {c['mode']:>8} {c['impl']:>10} {c['status']:>10}  {c.get('error', '')[:80]}")
            continue
        ratio = f"{c['ratio_vs_standard']:.2f}" if "ratio_vs_standard" in c else "-"
        path = f"  [{c['path']}]" if "path" in c else ""
        print(f"{c['seq']:>6} {c['mode']:>8} {c['impl']:>10} {c['ms']:>10.3f} {c['tflops']:>8.2f} {ratio:>6}{path}")

    if args.json:
        meta = dict(device=device.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup, interpret=args.interpret,
                    smoke=smoke, command=" ".join(sys.argv), flop_units=FLOP_UNITS, **cfg)
        meta["seqs"] = list(seqs)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, cells=cells), f, indent=2)
        print(f"wrote {args.json}")

"""Attention benchmark at the 3B shape (docs/design.md §4): fused DIFF vs the cuDNN composition vs XLA vs standard.

    python experiments/bench_attention.py                       # GPU: seq 2K/4K/8K/32K, causal, bf16
    python experiments/bench_attention.py --json out.json --seq 4096 8192 --impls pallas cudnn_std
    python experiments/bench_attention.py --interpret --small   # CPU smoke run: proves the script works

Cells: forward and forward+backward (one jitted vjp) per impl and length, the median of --iters calls after
--warmup. TFLOP/s: the algorithmic counts of docs/design.md §4 (`FLOP_UNITS`, units of h·N²·d, halved for causal),
the same for every DIFF impl. `ratio` = time(impl) / time(cudnn_std). An out-of-memory cell is reported, not fatal.
Numbers from --interpret/--small or a CPU backend are smoke-test output, not kernel performance.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import sys
from pathlib import Path

# diffjax first: jax's plugins then load quietly (diffjax/host.py)
import diffjax  # noqa: F401  # isort: skip

import jax
import jax.numpy as jnp
from benchlib import time_interleaved

from diffjax import kernels

# 3B model (paper Table 9): DIFF 12 heads of d = 128 (V 256); Transformer 24 heads of 128.
FULL = dict(batch=1, heads=12, head_dim=128, seqs=(2048, 4096, 8192, 32768))
SMALL = dict(batch=1, heads=2, head_dim=64, seqs=(128, 256))
IMPLS = ("pallas", "cudnn", "xla", "cudnn_std")
FLOP_UNITS = {"diff": {"fwd": 12, "fwd+bwd": 32}, "standard": {"fwd": 8, "fwd+bwd": 28}}


def runnable(impl: str, op: str):
    """(fn, how): the registry's `op` of `impl` on this host; how is None when native, else a GPU kernel runs its own
    code as this host can: a Pallas kernel in interpret mode ("interpret"), a cuDNN impl's calls through XLA ("xla")."""
    entry = kernels.IMPLS[impl]
    if entry.refuses(kernels.Call(op, kernels.normalize_platform(jax.default_backend()))) is None:
        return kernels.resolve(impl, op), None
    if impl.startswith("pallas") or impl == "mosaic_gpu":  # Pallas kernels: in interpret mode
        return functools.partial(kernels.resolve(impl, op, interpret=True), interpret=True), "interpret"
    fn = getattr(entry, op)
    if fn is not None and "implementation" in inspect.signature(fn).parameters:  # the cuDNN impls' XLA path
        return functools.partial(fn, implementation="xla"), "xla"
    raise ValueError(f"attention impl {impl!r} cannot run on {jax.default_backend()}, natively or emulated")


def _resolve(impl: str, interpret: bool):
    """(causal function, path) of a row (`cudnn_std`: cuDNN's `attention` op); path None when native. Without a GPU,
    `cudnn` runs its composition through XLA ("xla-fallback") and `cudnn_std` the `xla` impl (path "xla")."""
    op, name = ("attention", "cudnn") if impl == "cudnn_std" else ("diff_attention", impl)
    if interpret and name.startswith("pallas"):
        return functools.partial(kernels.resolve(name, op, interpret=True), causal=True, interpret=True), None
    fn, how = runnable(name, op)
    if how == "xla" and op == "attention":
        return functools.partial(kernels.resolve("xla", op), causal=True), "xla"
    return functools.partial(fn, causal=True), {"xla": "xla-fallback"}.get(how, how)


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


def step_fn(fn, mode: str):
    """What a cell times, a function of (args, ct): the forward ("fwd"), or every input's gradient for `ct` by vjp."""
    if mode == "fwd":
        return lambda args, ct: fn(*args)
    return lambda args, ct: jax.vjp(fn, *args)[1](ct)


def diff_candidates(platform: str, dtype: str = "bfloat16") -> list[str]:
    """The DIFF kernels to measure on `platform`: every registered impl whose `diff_attention` runs there on `dtype`,
    less those that also run on a CPU (reference math), and of several names for one program the first only."""
    args, _ = jax.eval_shape(lambda: inputs("diff", 1, 256, 2, 64, jnp.dtype(dtype)))
    programs = {}
    with kernels.targeting(platform):  # (`available` may ask which platform the kernels are chosen for)
        names = [n for n, e in kernels.IMPLS.items() if "cpu" not in e.platforms
                 and e.refuses(kernels.Call("diff_attention", platform, dtype)) is None]
        for name in names:  # traced only: no kernel is compiled
            fn = functools.partial(kernels.IMPLS[name].diff_attention, causal=True, segment_ids=None, interpret=False)
            try:
                program = str(jax.make_jaxpr(fn)(*args))
            except Exception:  # noqa: BLE001  not traceable on this host (cuDNN's calls without cuDNN): its own program
                program = name
            programs.setdefault(program, name)
    return list(programs.values())


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
        [times] = time_interleaved([(jax.jit(step_fn(fn, mode)), (args, ct))], warmup, iters)
        ms = 1e3 * statistics.median(times)
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

    cells = [bench_cell(impl, seq, mode, cfg, dtype, args.interpret, args.warmup, args.iters)
             for seq in seqs for mode in args.modes for impl in args.impls]
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
                    smoke=smoke, command=" ".join(sys.argv), flop_units=FLOP_UNITS, **cfg | dict(seqs=list(seqs)))
        Path(args.json).write_text(json.dumps(dict(meta=meta, cells=cells), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

"""Registers, spills, shared memory and executed matmul work of the Mosaic GPU kernels (`kernels/mosaic_gpu.py`),
from a CPU host (jax ≥ 0.11 with the CUDA plugin: `make test-newest-jax`'s `.venv312`).

    .venv312/bin/python experiments/mosaic_gpu_resources.py                   # d 64/128, DIFF and the standard op
    .venv312/bin/python experiments/mosaic_gpu_resources.py --dims 128 --maps 2 --blocks compute_wgs=1,v_chunk=64
    .venv312/bin/python experiments/mosaic_gpu_resources.py --json runs/mgpu_resources.json

Each configuration's training step (forward with residuals, dQ, dK/dV under `value_and_grad`) is compiled deviceless
for an H100 (sm_90a) in a child process with Mosaic GPU's dumps on (`MOSAIC_GPU_DUMP_PTXAS`, `MOSAIC_GPU_DUMP_TO`):
ptxas's report gives registers and spills, the kernel's resources its shared memory, and its IR the `wgmma` ops of
one pipeline step. A warpgroup runs the step's ops once per visited (64-row, tile) pair — each op, or one branch of
a pair split between two warpgroups by role — so a kernel's executed work per visible (query, key) pair is
Σ 2·m·n·k over the step's ops / (64 · tile), counted in the units of docs/kernels.md (h·N²·d, d the q/k head dim:
DIFF needs 12 forward + 20 backward).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SMEM_LIMIT = 227 * 1024  # an H100 block's opt-in dynamic shared memory
MASKS = {"causal+seg": (True, True), "causal": (True, False), "full+seg": (False, True), "full": (False, False)}
# (forward, backward) units the math needs (docs/design.md §4, "FLOPs"; S recomputed): DIFF, the standard op
ARITHMETIC = {2: (12, 20), 1: (4, 10)}
_WGMMA = re.compile(r"mosaic_gpu\.wgmma accumulator\([^:]*: vector<(\d+)x(\d+)xf32>\) a\([^:]*: \w+<\d+x(\d+)x")


def ptxas_report(text: str) -> dict:
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(re.search(r"Used (\d+) registers", text)[1]),
            "spill_stores": int(spill[1]) if spill else 0, "spill_loads": int(spill[2]) if spill else 0}


def step_flops(mlir: str) -> int:
    """Matmul FLOPs of the kernel's wgmma ops, from its Mosaic GPU IR before LLVM (which merges alike branches)."""
    return sum(2 * int(m) * int(n) * int(k) for m, n, k in _WGMMA.findall(mlir))


def kernels_in(dump: Path) -> dict[str, dict]:
    """{kernel name: registers, spills, shared memory, FLOPs of one step} from one compile's Mosaic GPU dump."""
    found = {}
    for report in dump.glob("*.ptxas"):
        name = report.name.removesuffix(".ptxas")
        smem = re.search(r"smem_scratch_bytes=(\d+)", (dump / f"{name}.resources.txt").read_text())
        found[re.sub(r"_\d+$", "", name)] = {  # the dump numbers the kernels: mgpu_diff_fwd_0
            **ptxas_report(report.read_text()), "smem": int(smem[1]),
            "step_flops": step_flops((dump / f"{name}.before_layout_inference.txt").read_text())}
    return found


def _compile(case: dict) -> None:
    """In the child: compile the training step of `case` for one H100 (the dump goes where the environment says)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from diffjax.aot import targets
    from diffjax.kernels import mosaic_gpu

    mesh = Mesh(np.array(targets.devices(targets.parse("h100x1"))[:1]), ("x",), axis_types=(AxisType.Auto,))
    rep = NamedSharding(mesh, P())
    t, d, maps = case["t"], case["d"], case["maps"]
    q = jax.ShapeDtypeStruct((1, t, case["heads"], d), jnp.bfloat16, sharding=rep)
    k = jax.ShapeDtypeStruct((1, t, case["kv_heads"], d), jnp.bfloat16, sharding=rep)
    v = jax.ShapeDtypeStruct((1, t, case["kv_heads"], maps * d), jnp.bfloat16, sharding=rep)
    seg = [jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep)] if case["segments"] else []
    args = (q, q, k, k, v, jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)) if maps == 2 else (q, k, v)
    op = mosaic_gpu.diff_attention if maps == 2 else mosaic_gpu.attention
    blocks = mosaic_gpu.BlockSizes(**case["blocks"]) if case["blocks"] else None

    def loss(*xs):
        out = op(*xs[:len(args)], causal=case["causal"], segment_ids=xs[len(args)] if seg else None,
                 block_sizes=blocks)
        return out.astype(jnp.float32).sum()

    with jax.set_mesh(mesh), targets.uncached():
        jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(*args, *seg).compile()


def launches(case: dict, name: str, blocks) -> tuple[int, int]:
    """(tile: keys per step for a forward/dQ step, queries per step for dK/dV; launches of this kernel)."""
    if name.endswith(("_dq", "fwd")):
        chunks = max(1, case["maps"] * case["d"] // blocks.v_chunk)
        by_map = case["maps"] == 2 and blocks.forward == "maps"  # one launch; each warpgroup one branch of a pair
        return blocks.block_k, (chunks if name.endswith("fwd") and not by_map else 1)
    return blocks.block_q_dkv, 1


def measure(case: dict) -> list[dict]:
    """One row per kernel of the case's training step, or one row with the compile's `error`."""
    from diffjax.kernels import mosaic_gpu

    blocks = mosaic_gpu.BlockSizes(**case["blocks"]) if case["blocks"] else mosaic_gpu.BlockSizes.get_default(
        case["d"])
    with tempfile.TemporaryDirectory(prefix="mgpu_resources_") as dump:
        env = {**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": dump,
               "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=env, capture_output=True,
                              text=True)
        if done.returncode:
            errors = re.findall(r"^\w*(?:Error|Exception): .*$", done.stderr, re.M) or done.stderr.splitlines()[-1:]
            return [{**case, "kernel": "train", "error": errors[-1][:300]}]
        rows = []
        for name, info in sorted(kernels_in(Path(dump)).items()):
            tile, n = launches(case, name, blocks)
            units = n * info["step_flops"] / (64 * tile * case["d"])  # per visible (query, key) pair, / d
            rows.append({**case, "blocks": vars(blocks) | {}, "kernel": name.removeprefix("mgpu_"), "launches": n,
                         "units": units, **info})
        return rows


def work(rows: list[dict]) -> dict:
    """Executed units of the training step against the arithmetic's, forward and backward."""
    fwd = sum(r["units"] for r in rows if r["kernel"].endswith("fwd"))
    bwd = sum(r["units"] for r in rows if not r["kernel"].endswith("fwd"))
    need = ARITHMETIC[rows[0]["maps"]]
    return {"forward": fwd, "backward": bwd, "ratio": (fwd + bwd) / sum(need), "arithmetic": need}


def markdown(rows: list[dict]) -> str:
    lines = ["| d | maps | mask | kernel | registers | spill st / ld (B) | smem (KiB) | units per launch × launches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mask = next(k for k, v in MASKS.items() if v == (r["causal"], r["segments"]))
        head = f"| {r['d']} | {r['maps']} | {mask} | "
        if "error" in r:
            lines.append(head + f"compile error: {r['error'].replace('|', '/')} ||||")
            continue
        spill = f"{r['spill_stores']} / {r['spill_loads']}"
        lines.append(head + f"{r['kernel']} | {r['registers']} | {spill} | {r['smem'] / 1024:.1f} | "
                     f"{r['units'] / r['launches']:g} × {r['launches']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="64,128")
    p.add_argument("--maps", default="2,1", help="comma-separated: 2 (DIFF, v of width 2d), 1 (the standard op)")
    p.add_argument("--masks", default="causal+seg,full", help=f"comma-separated, of {', '.join(MASKS)}")
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--blocks", default="", help="BlockSizes fields instead of the defaults, e.g. compute_wgs=1")
    p.add_argument("--json", help="write the rows and the work summary here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _compile(json.loads(args.child))
        return 0
    import jax

    blocks = {k: int(v) if v.isdigit() else v for k, v in (item.split("=") for item in args.blocks.split(",") if item)}
    print(f"jax {jax.__version__}, sm_90a", file=sys.stderr)
    rows, summaries = [], []
    for d, maps, mask in itertools.product(map(int, args.dims.split(",")), map(int, args.maps.split(",")),
                                           args.masks.split(",")):
        causal, segments = MASKS[mask]
        case = {"d": d, "maps": maps, "causal": causal, "segments": segments, "t": args.t, "heads": 4, "kv_heads": 2,
                "blocks": blocks}
        new = measure(case)
        rows += new
        print("\n".join(markdown(new).splitlines()[2:]), file=sys.stderr, flush=True)
        if "error" not in new[0]:
            summaries.append({"d": d, "maps": maps, "mask": mask, **work(new)})
    print(markdown(rows))
    print("| d | maps | mask | forward units | backward units | executed / arithmetic |\n|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['d']} | {s['maps']} | {s['mask']} | {s['forward']:g} / {s['arithmetic'][0]} | "
              f"{s['backward']:g} / {s['arithmetic'][1]} | {s['ratio']:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "work": summaries}, indent=1))
    bad = [r for r in rows if "error" in r or r["spill_stores"] or r["smem"] > SMEM_LIMIT]
    print(f"{len(rows)} kernels: {len(bad)} spill, exceed shared memory or failed to compile", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

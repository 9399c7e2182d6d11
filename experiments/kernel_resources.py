"""Registers, spills and shared memory of the fused Triton kernels (`kernels/pallas_gpu.py`), from a CPU host.

    python experiments/kernel_resources.py                      # sm_90a (H100), d 64/96/128, bf16 + f16, all masks
    python experiments/kernel_resources.py --arch sm_80 --dims 128 --dtypes bfloat16 --json runs/sm80.json
    python experiments/kernel_resources.py --dims 64 --masks causal+seg --blocks block_q=64,num_warps=4
    python experiments/kernel_resources.py --maps 1 --dims 64,128 --dtypes bfloat16   # the standard op's kernels

Each configuration's training step and inference forward are compiled deviceless for the target GPU with XLA's dump
on; `ptxas -v` on each kernel's PTX gives registers and spills, XLA's thunk sequence the shared memory and threads
(docs/kernels.md, "Registers and spills").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARCH_TARGET = {"sm_90a": "h100x1", "sm_80": "a100x1"}  # ptxas arch -> diffjax.aot target of that GPU
SMEM_LIMIT = {"sm_90a": 227 * 1024, "sm_80": 163 * 1024}  # opt-in dynamic shared memory per block
KERNELS = {"diff_flash_fwd": "fwd", "diff_flash_bwd_dq": "bwd dq", "diff_flash_bwd_dkv": "bwd dkv",
           "flash_fwd": "fwd", "flash_bwd_dq": "bwd dq", "flash_bwd_dkv": "bwd dkv"}
MASKS = {"causal+seg": (True, True), "causal": (True, False), "full+seg": (False, True), "full": (False, False)}
SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str = "sm_90a"
    d: int = 128  # q/k head dim; v's is 2d
    dtype: str = "bfloat16"
    causal: bool = True
    segments: bool = True
    t: int = 2048
    h: int = 4
    kv: int = 2  # GQA: the dK/dV kernel loops over the group
    maps: int = 2  # 2: DIFF (v of width 2d); 1: the standard op (`pallas_gpu.attention`, v of width d)

    @property
    def kernel_names(self) -> list[str]:
        """Entry names of the training step's kernels (forward, dQ, dK/dV)."""
        prefix = "diff_" if self.maps == 2 else ""
        return [f"{prefix}flash_fwd", f"{prefix}flash_bwd_dq", f"{prefix}flash_bwd_dkv"]

    @property
    def mask(self) -> str:
        return next(k for k, v in MASKS.items() if v == (self.causal, self.segments))


def find_ptxas() -> str | None:
    """The ptxas of the nvidia-cuda-nvcc-cu12 wheel (the one XLA's plugin uses), else the one on PATH."""
    with contextlib.suppress(ImportError):
        import nvidia.cuda_nvcc

        path = Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin" / "ptxas"
        if path.exists():
            return str(path)
    return shutil.which("ptxas")


def ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return f"{m[1]} ({m[2]})" if m else out.strip().splitlines()[-1]


def ptxas_info(ptx: Path, ptxas: str) -> dict:
    """`ptxas -v` for the arch the PTX targets: registers, spill store/load bytes, stack frame."""
    text = ptx.read_text()
    arch = re.search(r"^\.target\s+(\w+)", text, re.M)[1]
    # Hopper's warpgroup MMA needs 64-row tiles per warpgroup; smaller ones fall back to Ampere's mma.sync.
    mma = "+".join(name for name, op in (("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync")) if op in text)
    done = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True)
    log = done.stdout + done.stderr
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"ptx_arch": arch, "mma": mma or "none", "registers": int(re.search(r"Used (\d+) registers", log)[1]),
            "stack": int(spill[1]), "spill_stores": int(spill[2]), "spill_loads": int(spill[3])}


def kernels_in(dump: Path) -> dict[str, dict]:
    """{kernel name: ptx path, threads, dynamic shared memory} from one compile's XLA dump."""
    found = {}
    for ptx in dump.glob("*.ptx"):
        entry = re.search(r"\.entry\s+(\w+)", ptx.read_text())
        if entry and entry[1] in KERNELS:
            found[entry[1]] = {"ptx": ptx}
    for seq in dump.glob("*thunk_sequence.txt"):
        for m in re.finditer(r"\] (\w+) grid: \[[^]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes",
                             seq.read_text()):
            if m[1] in found:
                found[m[1]] |= {"threads": int(m[2]) * int(m[3]) * int(m[4]), "smem": int(m[5])}
    return found


@dataclasses.dataclass
class _Compiler:
    """Compile-only devices of one target (built once per process: the CUDA plugin's topology)."""

    arch: str

    def __post_init__(self):
        import numpy as np
        from jax.sharding import AxisType, Mesh

        from diffjax.aot import targets

        devices = targets.devices(targets.parse(ARCH_TARGET[self.arch]))
        self.mesh = Mesh(np.array(devices[:1]), ("x",), axis_types=(AxisType.Auto,))

    def compile(self, case: Case, training: bool, blocks, dump: Path) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from diffjax.aot import targets
        from diffjax.kernels import pallas_gpu

        rep = NamedSharding(self.mesh, P())
        dt = jnp.dtype(case.dtype)
        q = jax.ShapeDtypeStruct((1, case.t, case.h, case.d), dt, sharding=rep)
        k = jax.ShapeDtypeStruct((1, case.t, case.kv, case.d), dt, sharding=rep)
        v = jax.ShapeDtypeStruct((1, case.t, case.kv, case.maps * case.d), dt, sharding=rep)
        lam = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
        seg = [jax.ShapeDtypeStruct((1, case.t), jnp.int32, sharding=rep)] if case.segments else []
        kw = {"block_sizes": blocks} if blocks is not None else {}

        args = (q, q, k, k, v, lam) if case.maps == 2 else (q, k, v)
        op = pallas_gpu.diff_attention if case.maps == 2 else pallas_gpu.attention

        def attn(*xs):  # the op's arrays, then the segment ids if the case has them
            return op(*xs[:len(args)], causal=case.causal, segment_ids=xs[len(args)] if seg else None, **kw)

        def loss(*xs):
            return attn(*xs).astype(jnp.float32).sum()

        fn = jax.value_and_grad(loss, argnums=tuple(range(len(args)))) if training else attn
        with jax.set_mesh(self.mesh), targets.uncached():  # Triton reads the target GPU from the context mesh
            jax.jit(fn).lower(*args, *seg).compile(compiler_options={"xla_dump_to": str(dump), **_optimized()})


def _optimized() -> dict:
    """XLA's default backend optimization, whatever JAX was asked (JAX_DISABLE_MOST_OPTIMIZATIONS, which the test suite
    sets, lowers it and changes the registers ptxas assigns): the kernels measured are the ones users run."""
    from jax._src.lib import xla_client

    default = xla_client.CompileOptions().executable_build_options.debug_options
    return {"xla_backend_optimization_level": default.xla_backend_optimization_level,
            "xla_llvm_disable_expensive_passes": default.xla_llvm_disable_expensive_passes}


@dataclasses.dataclass
class Measurer:
    ptxas: str
    keep: Path | None = None  # keep each compile's dump under this folder
    _compilers: dict = dataclasses.field(default_factory=dict)

    def measure(self, case: Case, blocks=None) -> list[dict]:
        """One row per kernel: fwd (train), bwd dq, bwd dkv from the training step, fwd (infer) from inference.
        `blocks`: a pallas_gpu.BlockSizes to use instead of the defaults. A compile that fails (shared memory over
        the GPU's limit is a compile error) gives one row with its `error`."""
        from diffjax.kernels import pallas_gpu

        compiler = self._compilers.get(case.arch) or self._compilers.setdefault(case.arch, _Compiler(case.arch))
        used = (blocks or pallas_gpu.BlockSizes.get_default(case.d, case.dtype, case.arch)).clamp(case.t)
        rows = []
        for training in (True, False):
            name = (f"{case.arch}_d{case.d}_{SHORT[case.dtype]}_{case.mask}_maps{case.maps}_"
                    f"{'train' if training else 'infer'}")
            base = {**dataclasses.asdict(case), "mask": case.mask, "num_stages": used.num_stages}
            with tempfile.TemporaryDirectory(prefix="kernel_resources_") as tmp:
                dump = self.keep / name if self.keep else Path(tmp)
                start = time.perf_counter()
                try:
                    compiler.compile(case, training, blocks, dump)
                except Exception as e:  # noqa: BLE001 (reported as a row: the table goes on)
                    rows.append({**base, "kernel": "train" if training else "fwd (infer)",
                                 "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                    continue
                seconds = time.perf_counter() - start
                found = kernels_in(dump)
                want = case.kernel_names if training else case.kernel_names[:1]
                if missing := [k for k in want if k not in found]:
                    raise RuntimeError(f"{name}: no PTX for {missing} in the dump ({sorted(found)})")
                for kernel in want:
                    info = found[kernel]
                    role = KERNELS[kernel] + ((" (train)" if training else " (infer)") if kernel.endswith("fwd")
                                              else "")
                    bq, bk = _tile(used, kernel)
                    rows.append({**base, "kernel": role, "block_q": bq, "block_k": bk,
                                 "num_warps": info["threads"] // 32, "smem": info["smem"],
                                 "compile_s": round(seconds, 1), **ptxas_info(info["ptx"], self.ptxas)})
        return rows


def _tile(blocks, kernel: str) -> tuple[int, int]:
    suffix = {"fwd": "", "bwd dq": "_dq", "bwd dkv": "_dkv"}[KERNELS[kernel]]
    return getattr(blocks, "block_q" + suffix), getattr(blocks, "block_k" + suffix)


def spills(rows: list[dict]) -> list[dict]:
    """Rows whose kernel spills registers, or that did not compile."""
    return [r for r in rows if "error" in r or r["spill_stores"] or r["spill_loads"]]


def over_smem(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("smem", 0) > SMEM_LIMIT.get(r["arch"], 0)]


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | maps | d | dtype | arch | mask | block q × k | warps | stages | MMA | registers | "
             "spill st / ld (B) | smem (KiB) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = f"| {r['kernel']} | {r['maps']} | {r['d']} | {SHORT[r['dtype']]} | {r['arch']} | {r['mask']} | "
        if "error" in r:
            lines.append(first + f"compile error: {r['error'].replace('|', '/')} |||||||")
            continue
        spill = f"{r['spill_stores']} / {r['spill_loads']}"
        spill = f"**{spill}**" if r["spill_stores"] or r["spill_loads"] else spill
        smem = f"{r['smem'] / 1024:g}"
        smem = f"**{smem}**" if r["smem"] > SMEM_LIMIT.get(r["arch"], 0) else smem
        lines.append(first + f"{r['block_q']} × {r['block_k']} | {r['num_warps']} | {r['num_stages']} | {r['mma']} | "
                     f"{r['registers']} | {spill} | {smem} |")
    return "\n".join(lines) + "\n"


def _parse_blocks(text: str | None):
    if not text:
        return None
    from diffjax.kernels import pallas_gpu

    values = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    return pallas_gpu.BlockSizes(**values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90a", help=f"comma-separated, of {', '.join(ARCH_TARGET)}")
    p.add_argument("--dims", default="64,96,128")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated, of {', '.join(MASKS)}")
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--maps", default="2", help="comma-separated: 2 (DIFF), 1 (the standard op)")
    p.add_argument("--blocks", help="BlockSizes fields instead of the defaults, e.g. block_q=64,num_warps=8")
    p.add_argument("--ptxas", default=find_ptxas())
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--keep-dumps", help="keep each compile's XLA dump under this folder")
    args = p.parse_args(argv)
    if not args.ptxas:
        p.error("no ptxas found (pip install nvidia-cuda-nvcc-cu12, or --ptxas)")
    import jax

    import diffjax

    print(f"jax {jax.__version__}, ptxas {ptxas_version(args.ptxas)} ({args.ptxas}), {diffjax.__file__}",
          file=sys.stderr)
    measurer = Measurer(args.ptxas, Path(args.keep_dumps) if args.keep_dumps else None)
    blocks = _parse_blocks(args.blocks)
    rows = []
    for arch, d, dtype, mask, maps in itertools.product(args.arch.split(","), map(int, args.dims.split(",")),
                                                        args.dtypes.split(","), args.masks.split(","),
                                                        map(int, args.maps.split(","))):
        new = measurer.measure(Case(arch, d, dtype, *MASKS[mask], args.t, args.heads, args.kv_heads, maps), blocks)
        rows += new
        print("\n".join(markdown(new).splitlines()[2:]), file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad, big = spills(rows), over_smem(rows)
    print(f"{len(rows)} rows: {len(bad)} spill or failed to compile, {len(big)} over the shared-memory limit",
          file=sys.stderr)
    return 1 if bad or big else 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

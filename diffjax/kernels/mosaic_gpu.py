"""Fused differential flash attention on Pallas' Mosaic GPU backend (Hopper, sm_90a; docs/kernels.md, "The Mosaic
GPU kernel"): the algorithm of `pallas_gpu.py` written for warpgroups — TMA loads, `wgmma`, a memory warpgroup
feeding two compute warpgroups through pipelined K/V (or Q/dO) stages (`plgpu.emit_pipeline_warp_specialized`).

    out = (softmax(s·q1 k1ᵀ) − λ·softmax(s·q2 k2ᵀ)) v,   s = 1/√d

Forward: both online softmaxes in one pass, each K/V tile loaded once, the float32 epilogue `acc1/l1 − λ·acc2/l2`.
Backward: a dQ kernel (dP = dO·Vᵀ once per tile, shared by both maps) and a dK/dV kernel (dV = (P1 − λP2)ᵀ·dO once,
the GQA group summed in-kernel): the combined backward of docs/kernels.md; or, up to d = 64 (`dkv="fused"`), dQ formed
in the dK/dV kernel and summed over key tiles in float32 by TMA reduce-adds, as FlashAttention-3 does. The standard
op is the same kernels with one map. bf16/fp16 only (wgmma); float32 stays on the Triton and XLA paths.

Each kernel splits its work between two compute warpgroups by rows, by map (forward, dQ) or by output (dK/dV):
`BlockSizes`, `candidates`. On a GPU the wgmma accumulates in place and takes P and dS from registers; the interpret
mode that runs the kernels on a CPU (`plgpu.InterpretGPUParams`) takes operands from shared memory only, so there
they are staged (`_accumulate`, the one difference), and the device check's conformance checks the GPU path.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import xla_bridge  # backends_are_initialized: whether PJRT_NPROC can still take effect

from diffjax.kernels.common import LOG2E, NEG_INF, KernelConfig, combine, kernel_refs, public_ops, score_grad, weighted
from diffjax.kernels.fused_vjp import fused_attention

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a jaxlib without Mosaic GPU
    plgpu = None

_WGMMA_ROWS = 64  # a warpgroup's wgmma tile has 64 rows


def available() -> bool:
    """Whether this JAX runs the kernels: Mosaic GPU with the warp-specialized pipeline, from jax 0.11 (the GPU image's;
    jax 0.10's interpreter cannot load a shared-memory vector into registers, so nothing checks them there)."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    return plgpu is not None and hasattr(plgpu, "emit_pipeline_warp_specialized") and version >= (0, 11)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: query rows per compute warpgroup (`block_q`, forward and dQ) against `block_k` key rows per pipeline
    step; key rows per compute warpgroup (`block_k_dkv`) against `block_q_dkv` query rows per step (dK/dV). Each is
    a multiple of 64 (a warpgroup's wgmma has 64 rows; a 64-wide bf16 row is one 128-byte swizzle). `stages`: K/V
    tiles in flight. `v_chunk`: V columns one forward launch computes (two float32 [block_q, v_chunk] accumulators
    must fit a thread's registers); `dkv_split`: dK and dV in separate launches when V is wider than this."""

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    stages: int = 2
    compute_wgs: int = 2
    v_chunk: int = 128
    forward: str = "rows"
    dq: str = "rows"
    dkv: str = "rows"

    head_multiple = 64  # head dims are zero-padded to a multiple of this (`common.prepare`)

    def value_multiple(self, maps: int) -> int:
        """V's head dim is zero-padded to a multiple of this: split by map, each warpgroup writes half of V's
        columns, which must be whole 64-column tiles (a padded d < 64's 32 leave Mosaic no layout to infer)."""
        return 2 * self.head_multiple if maps == 2 and self.forward == "maps" else self.head_multiple

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "v_chunk"):
            value = getattr(self, f)
            if not isinstance(value, int) or value <= 0 or value % _WGMMA_ROWS:
                raise ValueError(f"mosaic_gpu.BlockSizes.{f} must be a positive multiple of 64, got {value!r}")
        if {self.forward, self.dq} - {"rows", "maps"} or self.dkv not in ("rows", "split", "pair", "fused"):
            raise ValueError(f"mosaic_gpu.BlockSizes: forward and dq are 'rows' or 'maps', dkv 'rows', 'split', "
                             f"'pair' or 'fused'; got {self.forward!r}, {self.dq!r}, {self.dkv!r}")
        if self.stages < 2 or self.compute_wgs not in (1, 2):
            raise ValueError(f"mosaic_gpu.BlockSizes: stages ≥ 2 and compute_wgs 1 or 2, got {self.stages}, "
                             f"{self.compute_wgs}")

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of every tile a launch covers."""
        return math.lcm(self.compute_wgs * self.block_q, self.block_k, self.block_q_dkv,
                        self.compute_wgs * self.block_k_dkv)

    def clamp(self, length: int) -> BlockSizes:
        return self  # tiles cannot shrink below wgmma's 64 rows: short sequences are padded

    @classmethod
    def get_default(cls, head_dim: int, causal: bool = True) -> BlockSizes:
        """The device check's measured winner for this head dim and masking (`TUNED`), else the candidate at which
        no kernel spills (`candidates`' first)."""
        winner = tuned(head_dim, causal)
        return cls(**winner["blocks"]) if winner else next(iter(candidates(head_dim).values()))


def candidates(head_dim: int) -> dict[str, BlockSizes]:
    """The tile sets the device check times at a head dim, the spill-free one first (experiments/
    mosaic_gpu_resources.py; docs/kernels.md, "The Mosaic GPU kernel"). Up to d = 64 two compute warpgroups on their
    own rows with dQ formed in the dK/dV kernel (the arithmetic's work, no more) or in its own, or on shared rows split
    by map; above, where two maps' accumulators do not fit a thread together, the split by map with dQ in its own
    kernel or (the arithmetic's work, some spilled registers) in the dK/dV kernel, or one warpgroup by rows (V in two
    forward launches, dK and dV apart).
    `--smoke --compile-only` compiles each for an H100."""
    if head_dim <= 64:
        return {"rows, dq in dkv": BlockSizes(compute_wgs=2, dkv="fused"),
                "rows": BlockSizes(compute_wgs=2, dkv="pair"),
                "maps": BlockSizes(compute_wgs=2, forward="maps", dq="maps", dkv="pair"),
                "rows, dkv rows": BlockSizes(compute_wgs=2, dkv="rows")}
    return {"maps": BlockSizes(compute_wgs=1, forward="maps", dq="maps", dkv="pair"),
            "maps, dq in dkv": BlockSizes(compute_wgs=1, forward="maps", dq="maps", dkv="fused"),
            "rows": BlockSizes(compute_wgs=1, dkv="split")}


TUNED = Path(__file__).with_name("mosaic_gpu_tuned.json")  # written by experiments/device_check.py's attention section


def _head_class(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128  # the candidates' classes (head dims are padded to a multiple of 64)


@functools.cache
def _tuned_table() -> tuple[dict, ...]:
    return tuple(json.loads(TUNED.read_text())["entries"]) if TUNED.exists() else ()


def tuned(head_dim: int, causal: bool) -> dict | None:
    """The device check's entry for (head dim, causal): the fastest conforming candidate, its time against the
    cuDNN composition's, the device and versions; None where no device has timed them."""
    return next((e for e in _tuned_table() if e["head_dim"] == _head_class(head_dim) and e["causal"] == causal),
                None)


def measured_faster() -> bool:
    """Whether a device check measured the kernel faster than cuDNN's DIFF composition (`auto` then takes it)."""
    return any(e["vs_cudnn"] < 1 for e in _tuned_table())


def _load(ref, layout):
    """A whole shared-memory vector into registers in `layout` (jax < 0.12 asks for an index: `()`, all of it)."""
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _transforms(cols: int, dtype):
    """Tiling and swizzle of a [rows, cols] shared-memory tile: the widest swizzle a row allows."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_transforms(shape[-1], dtype))


def _tile_spec(rows: int, cols: int, dtype):
    return plgpu.BlockSpec((rows, cols), lambda j: (j, 0), transforms=_transforms(cols, dtype))


def _row_spec(rows: int):
    return plgpu.BlockSpec((rows,), lambda j: (j,))


def _matmul(a_smem, b_smem, shape, more=()):
    """a·b (+ each a·b of `more`) in float32 (wgmma; operands in shared memory, b may be a transposed view)."""
    def run(acc):
        for a, b in ((a_smem, b_smem), *more):
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _stage(smem, x):
    """x stored to `smem` for a wgmma to read (the fence orders the store before the tensor core's reads)."""
    smem[...] = x.astype(smem.dtype)
    plgpu.commit_smem()
    return smem


def _accumulate(acc, a, b, cfg: KernelConfig, *, registers: bool = False, stage=None):
    """acc + a·b, a a shared-memory tile or (`registers`) a register tile. On a GPU the wgmma accumulates into acc's
    own registers (`pl.run_state`) and takes a register tile as its left operand, as FlashAttention-3 does; the
    interpreter runs neither, so there a register tile goes through the shared-memory tile `stage` and the product
    into a fresh accumulator."""
    if cfg.interpret:
        return acc + _matmul(_stage(stage, a) if registers else a, b, acc.shape)
    a = a.astype(b.dtype) if registers else a

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(run)(plgpu.ACC.init(acc))


def _rows(x, shape):  # a per-row vector broadcast over columns
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):  # a per-column vector broadcast over rows
    return lax.broadcast_in_dim(x, shape, [1])


def _masked(x, fill, q0, k0, cfg: KernelConfig, q_seg=None, k_seg=None, transposed=False):
    """x with `fill` where a (query, key) pair is not visible, for queries from q0 and keys from k0 (x is [keys,
    queries] when `transposed`). Key padding is masked only where the keys were padded (`common.prepare` pads them to
    a multiple of every tile): a mask term fewer is registers freed in the tightest kernels."""
    shape = x.shape
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    expand_q, expand_k = (_cols, _rows) if transposed else (_rows, _cols)

    def positions(start, dim):  # a vector, compared once broadcast: a thread keeps a few registers, not an int32 tile
        return start + plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=plgpu.Layout.WGMMA.reduce(1 - dim))
    k_pos = functools.cache(lambda: expand_k(positions(k0, k_dim), shape))  # only if used: an unused iota stalls
    masks = [expand_q(positions(q0, q_dim), shape) >= k_pos()] if cfg.causal else []  # Mosaic's layout inference
    masks += [k_pos() < cfg.kv_len] if cfg.kv_len % cfg.blocks.multiple else []
    if q_seg is not None:
        masks.append(expand_q(q_seg, shape) == expand_k(k_seg, shape))
    return jnp.where(functools.reduce(jnp.logical_and, masks), x, fill) if masks else x


def _key_blocks(tile_end, block: int, cfg: KernelConfig):
    """How many key blocks the pipeline loads for queries before `tile_end`: up to the last key a query sees (causal;
    traced, a dynamic pipeline grid) and never a block of padding alone."""
    n = -(-cfg.kv_len // block)
    return jnp.minimum(lax.div(tile_end + block - 1, block), n) if cfg.causal else n


def _visible(q0, q_rows, k0, cfg: KernelConfig):
    """Whether any key of the block from k0 is visible to the query block [q0, q0 + q_rows): skipped blocks cost a
    barrier, not their matmuls."""
    seen = k0 < cfg.kv_len
    return jnp.logical_and(seen, k0 <= q0 + q_rows - 1) if cfg.causal else seen


def _copy_in(pairs, barriers, wg, wgs: int):
    """TMA copies gmem → smem for warpgroup `wg` (of `wgs`), one barrier each, then wait for all."""
    mine = [barriers.at[n * wgs + wg] for n in range(len(pairs))]
    for (src, dst), barrier in zip(pairs, mine, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, barrier)
    for barrier in mine:
        plgpu.barrier_wait(barrier)


def _copy_out(pairs, reduction_op=None):
    """smem → gmem TMA stores (`reduction_op` "add": adds) of tiles already written by this warpgroup; waits until
    they are read."""
    plgpu.commit_smem()
    for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src, dst, reduction_op=reduction_op)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


INTERPRET_THREADS = 8  # PJRT CPU threads interpret mode runs on without deadlocking (tests/conftest.py sets it)


def _interpret_params():
    """Mosaic GPU's interpret mode (public from jax 0.11). Its warpgroups block in host callbacks, each holding one of
    the PJRT CPU client's threads (one per core unless PJRT_NPROC says otherwise): on a small CPU a kernel's three
    warpgroups deadlock, silently. So PJRT_NPROC is raised here while JAX's backends are not up yet, and a process
    whose CPU client has fewer threads is refused in one line."""
    threads = int(os.environ.get("PJRT_NPROC") or os.cpu_count() or 1)
    if threads < INTERPRET_THREADS:
        if not xla_bridge.backends_are_initialized():
            os.environ["PJRT_NPROC"] = str(INTERPRET_THREADS)
        else:
            raise RuntimeError(f"Mosaic GPU's interpret mode needs {INTERPRET_THREADS} PJRT CPU threads and this "
                               f"process's CPU client has {threads} (it would deadlock): set PJRT_NPROC="
                               f"{INTERPRET_THREADS} in the environment before JAX starts")
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _kernel(body, name: str, maps: int, args, out_type, scratch, grid, cfg: KernelConfig, wgs: int):
    """One launch; `name` (prefixed "diff_" for two maps) names its dumps (experiments/mosaic_gpu_resources.py)."""
    names = ("batch", "tile", "head")
    interpret = _interpret_params() if cfg.interpret else None
    body.__name__ = f"mgpu_{'diff_' if maps == 2 else ''}{name}"
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
                        num_threads=wgs + 1, thread_name="wg", interpret=interpret,
                        compiler_params=plgpu.CompilerParams(approx_math=True))(*args)


def _pipeline(body, grid, in_specs, context, cfg: KernelConfig, wgs: int):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=grid, in_specs=in_specs, memory_registers=24, wg_axis="wg",
        num_compute_wgs=wgs, max_concurrent_steps=cfg.blocks.stages, compute_context=context)


def _row_args(lam, seg, rows: int):
    """λ broadcast to a row of `rows` (a vector loads where a scalar cannot) and the segment ids, as kernel args."""
    return ([] if lam is None else [jnp.broadcast_to(lam.astype(jnp.float32), (rows,))]) + list(seg or [])


def _row_scratch(wgs: int, rows: int):
    """Shared memory for a warpgroup's λ row and query segment ids."""
    return plgpu.SMEM((wgs, rows), jnp.float32), plgpu.SMEM((wgs, rows), jnp.int32)


def _rows_in(lam_ref, q_seg_ref, lam_smem, seg_smem, bi, q0, rows, wg):
    """(gmem, smem) copies of λ's row and the rows' query segment ids, those the call has."""
    return ([] if lam_ref is None else [(lam_ref.at[pl.ds(0, rows)], lam_smem.at[wg])]) + (
        [] if q_seg_ref is None else [(q_seg_ref.at[bi, pl.ds(q0, rows)], seg_smem.at[wg])])


# ----------------------------------------------------------------------------------------------------- forward


def _forward(queries, keys, v, lam, seg, cfg: KernelConfig, residuals: bool):
    """Heads-major [B, H, T, d] inputs -> (o, [O_i], [lse_i]) as `pallas_gpu._forward`."""
    maps, dtype = len(queries), queries[0].dtype
    b, h, t, d = queries[0].shape
    n_kv, e = keys[0].shape[1], v.shape[-1]
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    ev = min(e, blk.v_chunk)
    res_dtype = jnp.dtype(cfg.residual_dtype or dtype)
    out_type = [jax.ShapeDtypeStruct((b, h, t, e), dtype)]
    if residuals:
        out_type += [jax.ShapeDtypeStruct((b, h, t, e), res_dtype)] * maps
        out_type += [jax.ShapeDtypeStruct((b, h, t), jnp.float32)] * maps
    scratch = [_smem((maps, wgs, bq, d), dtype), _smem((wgs, bq, bk), dtype), _smem((wgs, bq, ev), res_dtype),
               plgpu.SMEM((maps, wgs, bq), jnp.float32), *_row_scratch(wgs, bq),
               plgpu.Barrier(num_barriers=(maps + 2) * wgs)]
    if maps == 2 and blk.forward == "maps":
        # outputs are staged in Q's tiles (Q is no longer read) where they fit them: V's half as wide as Q (a padded
        # d < 64 has V narrower), the residuals in the inputs' dtype; else in tiles of their own
        own = {"out": e // 2 != d, "res": residuals and res_dtype != dtype}
        res_stage = [_smem((2, bq, e // 2), t) for t, mine in ((dtype, own["out"]), (res_dtype, own["res"])) if mine]
        scratch = [_smem((2, bq, d), dtype), _smem((4, bq, bk), dtype), *res_stage,
                   plgpu.SMEM((2, 2, bq), jnp.float32), plgpu.SMEM((2, 2, bq), jnp.float32), *_row_scratch(2, bq),
                   plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_arrivals=2, num_barriers=3)]
        kernel = functools.partial(_forward_by_map_kernel, cfg=cfg, residuals=residuals, group=h // n_kv, own=own)
        outs = _kernel(kernel, "fwd", maps, [*queries, *keys, v, *_row_args(lam, seg, bq)], out_type, scratch,
                       (b, t // bq, h), cfg, 2)
        return outs[0], outs[1:3], outs[3:]
    kernel = functools.partial(_forward_kernel, cfg=cfg, maps=maps, residuals=residuals, group=h // n_kv, ev=ev)
    outs = _kernel(kernel, "fwd", maps, [*queries, *keys, v, *_row_args(lam, seg, bq)], out_type, scratch,
                   (b, t // (wgs * bq), h * (e // ev)), cfg, wgs)
    o, rest = outs[0], outs[1:]
    return o, rest[:maps], rest[maps:]


def _forward_kernel(*refs, cfg: KernelConfig, maps: int, residuals: bool, group: int, ev: int):
    q_refs, k_refs, v_ref, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(refs, maps, cfg.has_seg)
    o_ref, *rest = rest
    res_refs, lse_refs = (rest[:maps], rest[maps:2 * maps]) if residuals else ([], [])
    q_smem, p_smem, o_smem, lse_smem, lam_smem, seg_smem, barriers = rest[2 * maps if residuals else 0:]
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    chunks = v_ref.shape[-1] // ev
    bi, head_chunk, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    hi, c = lax.div(head_chunk, chunks), lax.rem(head_chunk, chunks)
    q0 = lax.axis_index("tile") * (wgs * bq) + wg * bq
    row = plgpu.Layout.WGMMA.reduce(1)

    def compute(pipeline):
        q_in = [(r.at[bi, hi, pl.ds(q0, bq)], q_smem.at[i, wg]) for i, r in enumerate(q_refs)]
        _copy_in(q_in + _rows_in(lam_ref, q_seg_ref, lam_smem, seg_smem, bi, q0, bq, wg), barriers, wg, wgs)
        acc0 = plgpu.layout_cast(jnp.zeros((bq, ev), jnp.float32), plgpu.Layout.WGMMA)
        m0 = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), row)
        l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        states = pipeline(((acc0, m0, l0),) * maps)
        outs = [acc / _rows(l, acc.shape) for acc, _, l in states]  # noqa: E741
        lam = None if lam_ref is None else _rows(_load(lam_smem.at[wg], row), (bq, ev))
        dst = (bi, hi, pl.ds(q0, bq), pl.ds(c * ev, ev))
        o_smem.at[wg][...] = combine(outs, lam).astype(o_smem.dtype)  # float32 epilogue, one cast
        _copy_out([(o_smem.at[wg], o_ref.at[dst])])
        for out, res_ref in zip(outs if residuals else [], res_refs, strict=True):
            o_smem.at[wg][...] = out.astype(o_smem.dtype)
            _copy_out([(o_smem.at[wg], res_ref.at[dst])])
        if residuals:
            for i, (_, m, l) in enumerate(states):  # noqa: E741
                lse_smem.at[i, wg][...] = m + jnp.log2(l)

            @pl.when(c == 0)
            def _():
                _copy_out([(lse_smem.at[i, wg], r.at[bi, hi, pl.ds(q0, bq)]) for i, r in enumerate(lse_refs)])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_states):
        *tiles, states = tiles_and_states
        k_tiles, v_tile = tiles[:maps], tiles[maps]
        k0 = idx[0] * bk
        shape = (bq, bk)

        def visit(states):
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = _load(seg_smem.at[wg], row)
                k_seg = _load(tiles[maps + 1], plgpu.Layout.WGMMA.reduce(0))
            new = []
            for i, (acc, m, l) in enumerate(states):  # noqa: E741
                s = _matmul(q_smem.at[i, wg], k_tiles[i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                s = _masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - _rows(m_new, shape))
                acc = _accumulate(acc * _rows(alpha, acc.shape), p, v_tile, cfg, registers=True,
                                  stage=p_smem.at[wg])
                new.append((acc, m_new, l * alpha + p.sum(axis=1)))
            return tuple(new)

        return lax.cond(_visible(q0, bq, k0, cfg), visit, lambda states: states, states)

    kv = lax.div(hi, group)
    in_specs = [_tile_spec(bk, r.shape[-1], r.dtype) for r in k_refs] + [_tile_spec(bk, ev, v_ref.dtype)]
    gmem = [r.at[bi, kv] for r in k_refs] + [v_ref.at[bi, kv, :, pl.ds(c * ev, ev)]]
    if cfg.has_seg:
        in_specs.append(_row_spec(bk))
        gmem.append(k_seg_ref.at[bi])
    tile_end = (lax.axis_index("tile") + 1) * (wgs * bq)
    _pipeline(step, (_key_blocks(tile_end, bk, cfg),), in_specs, compute, cfg, wgs)(*gmem)


def _forward_by_map_kernel(*refs, cfg: KernelConfig, residuals: bool, group: int, own: dict):
    """DIFF's forward with the two compute warpgroups on the same query rows, one map's softmax each: warpgroup w
    computes S_w and its online softmax, shares P_w and its rescale α_w through shared memory, and accumulates both
    maps' P·V for its half of V's 2d columns. The logits once, no accumulator twice: 12 units of h·N²·d, two float32
    [rows, d] accumulators a thread (docs/kernels.md, "The Mosaic GPU kernel")."""
    q_refs, k_refs, v_ref, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(refs, 2, cfg.has_seg)
    o_ref, *rest = rest
    res_refs, lse_refs = (rest[:2], rest[2:4]) if residuals else ([], [])
    q_smem, p_smem, *res_stage, alpha_smem, l_smem, lam_smem, seg_smem, copies, shared = rest[4 if residuals else 0:]
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    half = v_ref.shape[-1] // 2
    bi, hi, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    q0 = lax.axis_index("tile") * bq
    row = plgpu.Layout.WGMMA.reduce(1)

    def by_map(fns, *args):  # the warpgroup's own map's branch (`wg` is traced: refs cannot be indexed by it)
        return lax.cond(wg == 0, fns[0], fns[1], *args)

    def exchange(slot):  # both warpgroups have stored what the other reads
        plgpu.commit_smem()
        plgpu.barrier_arrive(shared.at[slot])
        plgpu.barrier_wait(shared.at[slot])

    def compute(pipeline):
        for i, r in enumerate(q_refs):
            @pl.when(wg == i)
            def _(r=r, i=i):
                _copy_in([(r.at[bi, hi, pl.ds(q0, bq)], q_smem.at[i])] + _rows_in(
                    lam_ref, q_seg_ref, lam_smem, seg_smem, bi, q0, bq, wg), copies, wg, 2)
        zeros = plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), plgpu.Layout.WGMMA)
        m0 = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), row)
        l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        accs, m, l = pipeline(((zeros, zeros), m0, l0))  # noqa: E741
        l_smem.at[0, wg][...] = l
        exchange(2)
        ls = [_load(l_smem.at[0, i], row) for i in range(2)]
        outs = [acc / _rows(li, acc.shape) for acc, li in zip(accs, ls, strict=True)]
        lam = _rows(_load(lam_smem.at[wg], row), (bq, half))
        cols = (bi, hi, pl.ds(q0, bq), pl.ds(wg * half, half))
        tiles = iter(res_stage)
        stage = next(tiles) if own["out"] else q_smem
        stage = stage.at[wg]
        stage[...] = combine(outs, lam).astype(stage.dtype)  # float32 epilogue, one cast
        _copy_out([(stage, o_ref.at[cols])])
        stage = next(tiles).at[wg] if own["res"] else stage
        for out, res_ref in zip(outs if residuals else [], res_refs, strict=True):
            stage[...] = out.astype(stage.dtype)
            _copy_out([(stage, res_ref.at[cols])])
        for i, r in enumerate(lse_refs):
            @pl.when(wg == i)
            def _(r=r):
                l_smem.at[1, wg][...] = m + jnp.log2(l)
                _copy_out([(l_smem.at[1, wg], r.at[bi, hi, pl.ds(q0, bq)])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_state):
        *tiles, (accs, m, l) = tiles_and_state  # noqa: E741
        k_tiles, v_halves = tiles[:2], tiles[2:4]
        k0 = idx[0] * bk
        shape = (bq, bk)
        slot = lax.rem(idx[0], 2)  # P and α double-buffered: a warpgroup writes slot j + 2 after the other's step j
        # refs are indexed inside the branches: a transformed ref closed over from outside does not lower
        s = by_map([lambda i=i: _matmul(q_smem.at[i], k_tiles[i].transpose((1, 0)), shape)
                    for i in range(2)]) * (cfg.scale * LOG2E)
        q_seg = k_seg = None
        if cfg.has_seg:
            q_seg = _load(seg_smem.at[wg], row)
            k_seg = _load(tiles[4], plgpu.Layout.WGMMA.reduce(0))
        s = _masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - _rows(m_new, shape))
        # P of (slot, map) at 2·slot + map: a traced index (a literal one inside `pl.run_state` does not lower)
        p_smem.at[2 * slot + wg][...] = p.astype(p_smem.dtype)
        alpha_smem.at[slot, wg][...] = alpha
        exchange(slot)
        new = []
        for i, acc in enumerate(accs):  # P_i·V for this warpgroup's half of V's columns
            alpha_i = _load(alpha_smem.at[slot, i], row)
            acc = acc * _rows(alpha_i, acc.shape)
            new.append(by_map([lambda acc, i=i, v=v: _accumulate(acc, p_smem.at[2 * slot + i], v, cfg)
                               for v in v_halves], acc))
        return tuple(new), m_new, l * alpha + p.sum(axis=1)

    kv = lax.div(hi, group)
    in_specs = [_tile_spec(bk, r.shape[-1], r.dtype) for r in k_refs] + [_tile_spec(bk, half, v_ref.dtype)] * 2
    gmem = [r.at[bi, kv] for r in k_refs] + [v_ref.at[bi, kv, :, pl.ds(c * half, half)] for c in range(2)]
    if cfg.has_seg:
        in_specs.append(_row_spec(bk))
        gmem.append(k_seg_ref.at[bi])
    # every key block of the pipeline is visible to the rows' last query (no skipped step: the exchange needs both)
    _pipeline(step, (_key_blocks(q0 + bq, bk, cfg),), in_specs, compute, cfg, 2)(*gmem)


# ---------------------------------------------------------------------------------------------------- backward


def _backward_kernels(queries, keys, v, lam, seg, do, lses, rowsums, cfg: KernelConfig):
    """-> ([dq_i], [dk_i], dv) for heads-major inputs, one map or two (as `_forward`)."""
    maps, dtype = len(queries), queries[0].dtype
    b, h, t, d = queries[0].shape
    n_kv, s, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    blk = cfg.blocks
    wgs, group = blk.compute_wgs, h // n_kv
    rows = [*lses, *rowsums]
    lam_args = _row_args(lam, None, max(blk.block_q, blk.block_q_dkv))

    bq, bk = blk.block_q, blk.block_k
    scratch = [_smem((maps, wgs, bq, d), dtype), _smem((wgs, bq, e), dtype), _smem((wgs, bq, bk), dtype),
               plgpu.SMEM((2 * maps, wgs, bq), jnp.float32), *_row_scratch(wgs, bq),
               plgpu.Barrier(num_barriers=(3 * maps + 3) * wgs)]
    dq_type = [jax.ShapeDtypeStruct(q.shape, dtype) for q in queries]
    dq_args = [*queries, *keys, v, do, *rows, *lam_args, *(seg or [])]
    pair = blk.dkv in ("pair", "fused") and e == maps * d  # (the standard op with V wider than Q takes the split)
    # its reduce-adds sum dQ in the order the tiles finish, so XLA's deterministic mode (cuDNN's attention backward
    # obeys it too) takes dQ's own kernel
    fused = pair and blk.dkv == "fused" and "--xla_gpu_deterministic_ops=true" not in os.environ.get("XLA_FLAGS", "")
    if fused:
        d_queries = None  # dQ comes out of the dK/dV kernel
    elif maps == 2 and blk.dq == "maps":
        stage = [_smem((2, bq, bk), dtype)] if cfg.interpret else []  # register tiles' staging, interpret only
        scratch = [_smem((2, bq, d), dtype), _smem((bq, e), dtype), plgpu.SMEM((bq, bk), jnp.float32), *stage,
                   plgpu.SMEM((2, 2, bq), jnp.float32), *_row_scratch(2, bq), plgpu.Barrier(num_barriers=10),
                   plgpu.Barrier(num_arrivals=2, num_barriers=2)]
        d_queries = _kernel(functools.partial(_dq_by_map_kernel, cfg=cfg, group=group), "dq", maps, dq_args,
                            dq_type, scratch, (b, t // bq, h), cfg, 2)
    else:
        d_queries = _kernel(functools.partial(_dq_kernel, cfg=cfg, maps=maps, group=group), "dq", maps, dq_args,
                            dq_type, scratch, (b, t // (wgs * bq), h), cfg, wgs)

    # dK/dV: each compute warpgroup (a pair with dkv="pair") owns block_k_dkv keys of one kv head and walks the query
    # rows of its GQA group (heads-major, the group's heads are contiguous rows: [B, K, g·T, ·]).
    bq, bk = blk.block_q_dkv, blk.block_k_dkv
    flat = lambda x: x.reshape(b, n_kv, group * t, *x.shape[3:])  # noqa: E731
    args = [*map(flat, queries), *keys, v, flat(do), *map(flat, rows), *lam_args, *(seg or [])]
    if pair:
        stage = [_smem((2, bk, bq), dtype)] if cfg.interpret else []  # register tiles' staging, interpret only
        # K and V chunks (and dS of each map) as separate tiles: a literal index into a shared tile does not lower
        # inside `pl.run_state`; with `fused` the dS tiles and a float32 dQ tile for the partial sums. Above d = 64
        # these do not fit beside the pipeline's tiles (262 KiB of 227), so there (`compact`) P is handed over in 16
        # bits, each dSᵢ goes through P's tile, and dQ through one [rows, 64] float32 tile, a column half at a time
        compact = fused and d > 64
        dq_tiles = ([] if compact else [_smem((bk, bq), dtype) for _ in range(maps)]) + [
            plgpu.SMEM((bq, min(d, 64)), jnp.float32)] if fused else []
        p_tile = _smem((bk, bq), dtype) if compact else plgpu.SMEM((bk, bq), jnp.float32)
        scratch = [*[_smem((bk, d), dtype) for _ in range(2 * maps)], *dq_tiles, p_tile,
                   *stage, plgpu.SMEM((bq,), jnp.float32), plgpu.SMEM((bk,), jnp.int32),
                   plgpu.Barrier(num_barriers=2 * (maps + 2)), plgpu.Barrier(num_barriers=2),
                   plgpu.Barrier(num_arrivals=2)]
        kernel = functools.partial(_dkv_pair_kernel, cfg=cfg, maps=maps, group=group, fused=fused, compact=compact)
        out_type = [jax.ShapeDtypeStruct(k.shape, dtype) for k in keys] + [jax.ShapeDtypeStruct(v.shape, dtype)]
        if not fused:
            grads = _kernel(kernel, "dkv", maps, args, out_type, scratch, (b, s // bk, n_kv), cfg, 2)
            return list(d_queries), grads[:maps], grads[maps]
        # dQ summed over the key tiles in float32 in place (zeros in, TMA reduce-adds); the interpreter has no TMA
        # reduction, so there each key tile's partial goes apart and XLA sums them
        dq_shape = (b, n_kv, *((s // bk,) if cfg.interpret else ()), group * t, d)
        zeros = [jnp.zeros(o.shape, o.dtype) for o in out_type] + [jnp.zeros(dq_shape, jnp.float32)] * maps
        outs = pl.run_state(lambda refs: _kernel(kernel, "dkv", maps, [*args, *refs], (), scratch,
                                                 (b, s // bk, n_kv), cfg, 2))(zeros)
        d_queries = [(x.sum(2) if cfg.interpret else x).reshape(queries[0].shape).astype(dtype)
                     for x in outs[maps + 1:]]
        return d_queries, list(outs[:maps]), outs[maps]
    parts = [(True, True)] if blk.dkv == "rows" else [(True, False), (False, True)]  # "split", or "pair" refused
    grads = []
    for want_dk, want_dv in parts:
        scratch = [_smem((maps, wgs, bk, d), dtype), _smem((wgs, bk, e), dtype), _smem((wgs, bk, bq), dtype),
                   plgpu.SMEM((wgs, bq), jnp.float32), plgpu.SMEM((wgs, bk), jnp.int32),
                   plgpu.Barrier(num_barriers=(maps + 3) * wgs)]
        out_type = ([jax.ShapeDtypeStruct(k.shape, dtype) for k in keys] if want_dk else []) + (
            [jax.ShapeDtypeStruct(v.shape, dtype)] if want_dv else [])
        grads += _kernel(functools.partial(_dkv_kernel, cfg=cfg, maps=maps, group=group, want_dk=want_dk,
                                           want_dv=want_dv), "d" + "k" * want_dk + "v" * want_dv, maps,
                         args, out_type, scratch, (b, s // (wgs * bk), n_kv), cfg, wgs)
    return list(d_queries), grads[:maps], grads[maps]


def _dq_kernel(*refs, cfg: KernelConfig, maps: int, group: int):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    dq_refs, (q_smem, do_smem, ds_smem, stat_smem, lam_smem, seg_smem, barriers) = rest[:maps], rest[maps:]
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    bi, hi, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    q0 = lax.axis_index("tile") * (wgs * bq) + wg * bq
    row = plgpu.Layout.WGMMA.reduce(1)
    q_rows = pl.ds(q0, bq)
    stat_refs = [*lse_refs, *d_refs]

    def compute(pipeline):
        pairs = [(r.at[bi, hi, q_rows], q_smem.at[i, wg]) for i, r in enumerate(q_refs)]
        pairs += [(do_ref.at[bi, hi, q_rows], do_smem.at[wg])]
        pairs += [(r.at[bi, hi, q_rows], stat_smem.at[n, wg]) for n, r in enumerate(stat_refs)]
        pairs += _rows_in(lam_ref, q_seg_ref, lam_smem, seg_smem, bi, q0, bq, wg)
        _copy_in(pairs, barriers, wg, wgs)
        zeros = plgpu.layout_cast(jnp.zeros((bq, q_refs[0].shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        dqs = pipeline((zeros,) * maps)
        for i, (dq, dq_ref) in enumerate(zip(dqs, dq_refs, strict=True)):
            q_smem.at[i, wg][...] = (dq * cfg.scale).astype(q_smem.dtype)  # Q is no longer read: its tile stages dQ
            _copy_out([(q_smem.at[i, wg], dq_ref.at[bi, hi, q_rows])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_dqs):
        *tiles, dqs = tiles_and_dqs
        k_tiles, v_tile = tiles[:maps], tiles[maps]
        k0 = idx[0] * bk
        shape = (bq, bk)

        def visit(dqs):
            # per-row statistics stay vectors, broadcast where used: a broadcast [rows, keys] tile held across the
            # step costs a thread 32 registers
            stats = [_load(stat_smem.at[n, wg], row) for n in range(2 * maps)]
            lses, rowsums = stats[:maps], stats[maps:]
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = _load(seg_smem.at[wg], row)
                k_seg = _load(tiles[maps + 1], plgpu.Layout.WGMMA.reduce(0))
            dp = _matmul(do_smem.at[wg], v_tile.transpose((1, 0)), shape)  # once for every map
            lam = None if lam_ref is None else _load(lam_smem.at[wg], row)
            new = []
            for i, (dq, k_tile) in enumerate(zip(dqs, k_tiles, strict=True)):  # one map's tiles live at a time
                s = _matmul(q_smem.at[i, wg], k_tile.transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                # P_i from the saved log-sum-exp, masked per map (a mask kept across dP costs registers)
                p = _masked(jnp.exp2(s - _rows(lses[i], shape)), 0.0, q0, k0, cfg, q_seg, k_seg)
                ds = score_grad(i, p, dp, _rows(rowsums[i], shape), None if lam is None else _rows(lam, shape))
                new.append(_accumulate(dq, ds, k_tile, cfg, registers=True, stage=ds_smem.at[wg]))
            return tuple(new)

        if wgs == 1:  # every step of the pipeline is visible to the one warpgroup's rows
            return visit(dqs)
        return lax.cond(_visible(q0, bq, k0, cfg), visit, lambda dqs: dqs, dqs)

    tile_end = (lax.axis_index("tile") + 1) * (wgs * bq)
    _dq_pipeline(step, compute, [*k_refs, v_ref], k_seg_ref, bi, lax.div(hi, group), tile_end, cfg, wgs)


def _dq_pipeline(step, compute, kv_refs, k_seg_ref, bi, kv, tile_end, cfg: KernelConfig, wgs: int):
    """dQ's pipeline: the K and V tiles of kv head `kv` (and the key ids) up to the last key visible before
    `tile_end`."""
    bk = cfg.blocks.block_k
    in_specs = [_tile_spec(bk, r.shape[-1], r.dtype) for r in kv_refs]
    gmem = [r.at[bi, kv] for r in kv_refs]
    if cfg.has_seg:
        in_specs.append(_row_spec(bk))
        gmem.append(k_seg_ref.at[bi])
    _pipeline(step, (_key_blocks(tile_end, bk, cfg),), in_specs, compute, cfg, wgs)(*gmem)


def _dq_by_map_kernel(*refs, cfg: KernelConfig, group: int):
    """DIFF's dQ with the two compute warpgroups on the same query rows, one map each: warpgroup w accumulates
    dQ_w += dS_w·K_w, computing dP = dO·Vᵀ for half of each tile's keys and sharing it through shared memory, so dP
    is formed once and a thread holds one float32 [rows, d] accumulator (two do not fit at d = 128): 12 units."""
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, 2, cfg.has_seg, backward=True)
    dq_refs, (q_smem, do_smem, dp_smem, *stage, stat_smem, lam_smem, seg_smem, copies, shared) = rest[:2], rest[2:]
    written, read = shared.at[0], shared.at[1]  # both halves of dP are in the tile; both warpgroups have read it
    stage = stage[0] if stage else None
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    half = bk // 2
    bi, hi, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    q0 = lax.axis_index("tile") * bq
    row = plgpu.Layout.WGMMA.reduce(1)
    q_rows = pl.ds(q0, bq)

    def by_map(fns, *args):  # the warpgroup's own map's branch (as `_forward_by_map_kernel`)
        return lax.cond(wg == 0, fns[0], fns[1], *args)

    def compute(pipeline):
        mine = []  # each warpgroup copies its map's rows; warpgroup 0 also dO and the query ids, which both read
        for i in range(2):
            pairs = [(q_refs[i].at[bi, hi, q_rows], q_smem.at[i]), (lse_refs[i].at[bi, hi, q_rows], stat_smem.at[0, i]),
                     (d_refs[i].at[bi, hi, q_rows], stat_smem.at[1, i]), (lam_ref.at[pl.ds(0, bq)], lam_smem.at[i])]
            if i == 0:
                pairs.append((do_ref.at[bi, hi, q_rows], do_smem))
                pairs += [] if q_seg_ref is None else [(q_seg_ref.at[bi, q_rows], seg_smem.at[0])]
            mine.append([(src, dst, copies.at[6 * i + n]) for n, (src, dst) in enumerate(pairs)])

            @pl.when(wg == i)
            def _(pairs=mine[i]):
                for src, dst, barrier in pairs:
                    plgpu.copy_gmem_to_smem(src, dst, barrier)
        for _, _, barrier in mine[0]:
            plgpu.barrier_wait(barrier)

        @pl.when(wg == 1)
        def _():
            for _, _, barrier in mine[1]:
                plgpu.barrier_wait(barrier)
        zeros = plgpu.layout_cast(jnp.zeros((bq, q_refs[0].shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        dq = pipeline(zeros)
        q_smem.at[wg][...] = (dq * cfg.scale).astype(q_smem.dtype)  # Q is no longer read: its tile stages dQ
        for i, dq_ref in enumerate(dq_refs):
            pl.when(wg == i)(lambda dq_ref=dq_ref: _copy_out([(q_smem.at[wg], dq_ref.at[bi, hi, q_rows])]))
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_dq):
        *tiles, dq = tiles_and_dq
        k_tiles, v_tile = tiles[:2], tiles[2]
        k0 = idx[0] * bk
        shape = (bq, bk)
        def dp_half(c):  # dP for keys [c·half, (c + 1)·half) of the tile, into the one shared tile once both have read
            part = _matmul(do_smem, v_tile.at[pl.ds(c * half, half)].transpose((1, 0)), (bq, half))
            pl.when(idx[0] > 0)(lambda: plgpu.barrier_wait(read))
            dp_smem.at[:, pl.ds(c * half, half)][...] = part
        by_map([functools.partial(dp_half, c) for c in range(2)])
        plgpu.barrier_arrive(written)
        s = by_map([lambda i=i: _matmul(q_smem.at[i], k_tiles[i].transpose((1, 0)), shape) for i in range(2)])
        q_seg = _load(seg_smem.at[0], row) if cfg.has_seg else None
        k_seg = _load(tiles[3], plgpu.Layout.WGMMA.reduce(0)) if cfg.has_seg else None
        lse, rowsum = (_load(stat_smem.at[n, wg], row) for n in range(2))
        p = _masked(jnp.exp2(s * (cfg.scale * LOG2E) - _rows(lse, shape)), 0.0, q0, k0, cfg, q_seg, k_seg)  # P_w
        lam = _load(lam_smem.at[wg], row)
        c = by_map([lambda i=i: weighted(i, jnp.ones_like(lam), lam) for i in range(2)])  # 1 or −λ
        plgpu.barrier_wait(written)
        dp = _load(dp_smem, plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(read)
        ds = score_grad(0, p, dp, _rows(rowsum, shape), None) * _rows(c, shape)
        return by_map([lambda dq, i=i: _accumulate(dq, ds, k_tiles[i], cfg, registers=True,
                                                     stage=None if stage is None else stage.at[i])
                       for i in range(2)], dq)

    # every key block of the pipeline is visible to the rows' last query (no skipped step: the exchange needs both)
    _dq_pipeline(step, compute, [*k_refs, v_ref], k_seg_ref, bi, lax.div(hi, group), q0 + bq, cfg, 2)


def _dkv_kernel(*refs, cfg: KernelConfig, maps: int, group: int, want_dk: bool, want_dv: bool):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    n_out = maps * want_dk + want_dv
    outs, (k_smem, v_smem, p_smem, lam_smem, seg_smem, barriers) = rest[:n_out], rest[n_out:]
    dk_refs, dv_ref = (outs[:maps], outs[maps:]) if want_dk else ([], outs)
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q_dkv, blk.block_k_dkv, blk.compute_wgs
    t = q_refs[0].shape[2] // group
    bi, ki, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    k0 = lax.axis_index("tile") * (wgs * bk) + wg * bk
    k_rows = pl.ds(k0, bk)
    # The query blocks of each head of the group that can see this tile's keys: causal, from the diagonal on
    # (traced, a dynamic pipeline grid). Step j is block `first + j mod per_head` of head `j // per_head`.
    first = lax.div(lax.axis_index("tile") * (wgs * bk), bq) if cfg.causal else 0
    per_head = t // bq - first

    def q_block(j):  # of the group's g·T rows
        return lax.div(j, per_head) * (t // bq) + first + lax.rem(j, per_head)

    col = plgpu.Layout.WGMMA.reduce(0)
    d, e = k_refs[0].shape[-1], v_ref.shape[-1]
    shape = (bk, bq)  # tiles transposed: [keys, queries], so dV and dK accumulate with the tile as wgmma's lhs

    def compute(pipeline):
        pairs = [(r.at[bi, ki, k_rows], k_smem.at[i, wg]) for i, r in enumerate(k_refs)]
        pairs += [(v_ref.at[bi, ki, k_rows], v_smem.at[wg])]
        pairs += [] if lam_ref is None else [(lam_ref.at[pl.ds(0, bq)], lam_smem.at[wg])]
        pairs += [] if k_seg_ref is None else [(k_seg_ref.at[bi, k_rows], seg_smem.at[wg])]
        _copy_in(pairs, barriers, wg, wgs)
        acc = lambda n: plgpu.layout_cast(jnp.zeros((bk, n), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
        dks, dv = pipeline(((acc(d),) * maps if want_dk else (), acc(e) if want_dv else None))
        # K and V are no longer read: their tiles stage dK and dV
        results = [(dk * cfg.scale, r, k_smem.at[i, wg]) for i, (dk, r) in enumerate(zip(dks, dk_refs, strict=True))]
        results += [(dv, dv_ref[0], v_smem.at[wg])] if want_dv else []
        for x, ref, stage in results:
            stage[...] = x.astype(stage.dtype)
            _copy_out([(stage, ref.at[bi, ki, k_rows])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_acc):
        *tiles, (dks, dv) = tiles_and_acc
        q_tiles, do_tile = tiles[:maps], tiles[maps]
        stat_tiles = tiles[maps + 1:3 * maps + 1]
        q0 = lax.rem(q_block(idx[0]), t // bq) * bq

        def visit(carry):
            dks, dv = carry
            stats = [_load(r, col) for r in stat_tiles]  # vectors, broadcast where used (as in the dQ kernel)
            lses, rowsums = stats[:maps], stats[maps:]
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = _load(tiles[3 * maps + 1], col)
                k_seg = _load(seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
            ps = []
            for i in range(maps):  # Pᵢᵀ from Sᵢᵀ = Kᵢ·Qᵢᵀ and the saved log-sum-exps
                s = _matmul(k_smem.at[i, wg], q_tiles[i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                ps.append(_masked(jnp.exp2(s - _cols(lses[i], shape)), 0.0, q0, k0, cfg, q_seg, k_seg,
                                  transposed=True))
            lam = None if lam_ref is None else _cols(_load(lam_smem.at[wg], col), shape)
            if want_dv:  # dV += (P1 − λP2)ᵀ·dO, once for both maps
                dv = _accumulate(dv, combine(ps, lam), do_tile, cfg, registers=True, stage=p_smem.at[wg])
            if want_dk:  # dPᵀ = V·dOᵀ once; dKᵢ += dSᵢᵀ·Qᵢ
                dp = _matmul(v_smem.at[wg], do_tile.transpose((1, 0)), shape)
                dks = tuple(_accumulate(dk, score_grad(i, ps[i], dp, _cols(rowsums[i], shape), lam), q_tile, cfg,
                                        registers=True, stage=p_smem.at[wg])
                            for i, (dk, q_tile) in enumerate(zip(dks, q_tiles, strict=True)))
            return dks, dv

        return lax.cond(_visible(q0, bq, k0, cfg), visit, lambda carry: carry, (dks, dv))

    in_specs = [plgpu.BlockSpec((bq, r.shape[-1]), lambda j: (q_block(j), 0), transforms=_transforms(r.shape[-1],
                                                                                                   r.dtype))
                for r in (*q_refs, do_ref)] + [plgpu.BlockSpec((bq,), lambda j: (q_block(j),))] * (2 * maps)
    gmem = [r.at[bi, ki] for r in (*q_refs, do_ref, *lse_refs, *d_refs)]
    if cfg.has_seg:  # every head of the group has the batch row's query ids
        in_specs.append(plgpu.BlockSpec((bq,), lambda j: (lax.rem(q_block(j), t // bq),)))
        gmem.append(q_seg_ref.at[bi])
    _pipeline(step, (group * per_head,), in_specs, compute, cfg, wgs)(*gmem)


def _dkv_pair_kernel(*refs, cfg: KernelConfig, maps: int, group: int, fused: bool, compact: bool = False):
    """dK/dV with two compute warpgroups on the same keys, split by output. Warpgroup 0 forms Pᵢᵀ (Sᵢᵀ = Kᵢ·Qᵢᵀ and
    the saved log-sum-exps) and accumulates dV += (P1 − λP2)ᵀ·dO; warpgroup 1 forms dPᵀ = V·dOᵀ and accumulates
    dKᵢ += dSᵢᵀ·Qᵢ, taking each cᵢ·Pᵢᵀ (c = 1, −λ) from warpgroup 0 through one float32 shared-memory tile. Each holds
    `maps` float32 [keys, d] accumulators (dV in column chunks of d), so d = 128 fits a thread's registers where one
    warpgroup holding dK1, dK2 and dV does not: 16 units of h·N²·d in one launch. `fused` (FlashAttention-3's
    backward): warpgroup 1 also forms these keys' share of each dQᵢ = dSᵢ·Kᵢ and adds it into a float32 dQ in global
    memory (a TMA reduce-add), so no dQ kernel forms S and dP again: 20 units, the arithmetic's. `compact` (fused at
    d > 64, for shared memory): Pᵢ handed over in 16 bits, dSᵢ written into its tile (released once dQ's product has
    read it), dQ added in 64-column halves."""
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    n_dq = maps if fused else 0
    dk_refs, dv_ref, dq_refs, rest = rest[:maps], rest[maps], rest[maps + 1:maps + 1 + n_dq], rest[maps + 1 + n_dq:]
    k_smem, v_smem, rest = rest[:maps], rest[maps:2 * maps], rest[2 * maps:]
    n_ds = maps if fused and not compact else 0
    ds_tiles, dq_tile, rest = (rest[:n_ds], rest[n_ds], rest[n_ds + 1:]) if fused else ([], None, rest)
    p_smem, *stage, lam_smem, seg_smem, copies, handoff, done = rest
    stages = [stage[0].at[w] for w in range(2)] if stage else [None, None]  # each warpgroup its own
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    t = q_refs[0].shape[2] // group
    chunk = v_ref.shape[-1] // maps  # = d
    bi, ki, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    k0 = lax.axis_index("tile") * bk
    k_rows = pl.ds(k0, bk)
    first = lax.div(k0, bq) if cfg.causal else 0  # as `_dkv_kernel`: each head's query blocks from the diagonal on
    per_head = t // bq - first

    def q_block(j):
        return lax.div(j, per_head) * (t // bq) + first + lax.rem(j, per_head)

    col = plgpu.Layout.WGMMA.reduce(0)
    shape = (bk, bq)
    ready, free = handoff.at[0], handoff.at[1]  # P in the tile; the tile read

    def compute(pipeline):
        @pl.when(wg == 0)  # K, λ and the key ids for the scores
        def _():
            pairs = [(r.at[bi, ki, k_rows], k_smem[i]) for i, r in enumerate(k_refs)]
            pairs += [] if lam_ref is None else [(lam_ref.at[pl.ds(0, bq)], lam_smem)]
            pairs += [] if k_seg_ref is None else [(k_seg_ref.at[bi, k_rows], seg_smem)]
            _copy_in(pairs, copies, 0, 2)

        @pl.when(wg == 1)  # V for dP, in the column chunks dV is kept in
        def _():
            _copy_in([(v_ref.at[bi, ki, k_rows, pl.ds(c * chunk, chunk)], v_smem[c]) for c in range(maps)],
                     copies, 1, 2)

        zeros = plgpu.layout_cast(jnp.zeros((bk, chunk), jnp.float32), plgpu.Layout.WGMMA)
        accs = pipeline((zeros,) * maps)
        plgpu.barrier_arrive(done)  # both are done reading K and V, whose tiles now stage the results
        plgpu.barrier_wait(done)

        def store(accs, stages, outs):
            for acc, tile, (ref, cols) in zip(accs, stages, outs, strict=True):
                tile[...] = acc.astype(tile.dtype)
                _copy_out([(tile, ref.at[bi, ki, k_rows, cols])])
        pl.when(wg == 0)(lambda: store(accs, v_smem,
                                       [(dv_ref, pl.ds(c * chunk, chunk)) for c in range(maps)]))
        pl.when(wg == 1)(lambda: store([a * cfg.scale for a in accs], k_smem,
                                       [(r, slice(None)) for r in dk_refs]))
        plgpu.wait_smem_to_gmem(0)

    def step(idx, *tiles_and_accs):
        *tiles, accs = tiles_and_accs
        q_tiles, do_tiles = tiles[:maps], tiles[maps:2 * maps]
        lse_tiles, d_tiles = tiles[2 * maps:3 * maps], tiles[3 * maps:4 * maps]
        q0 = lax.rem(q_block(idx[0]), t // bq) * bq

        def values(accs):  # warpgroup 0
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = _load(tiles[4 * maps], col)
                k_seg = _load(seg_smem, plgpu.Layout.WGMMA.reduce(1))
            weights = 0.0  # dV's: Σ cᵢ·Pᵢᵀ = (P1 − λP2)ᵀ, built one map at a time (one map's tiles live at once)
            for i in range(maps):  # Pᵢᵀ from Sᵢᵀ = Kᵢ·Qᵢᵀ and the saved log-sum-exps
                s = _matmul(k_smem[i], q_tiles[i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                # the logits masked, not P (every query sees a key, so its lse is finite and exp2 of a masked logit
                # is 0), and λ loaded where used: at d = 128 either alone decides whether this warpgroup spills
                s = _masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg, transposed=True)
                p = jnp.exp2(s - _cols(_load(lse_tiles[i], col), shape))
                p = weighted(i, p, None if lam_ref is None else _cols(_load(lam_smem, col), shape))

                @pl.when(idx[0] + i > 0)  # cᵢ·Pᵢᵀ to warpgroup 1 through the one tile, once it has read the last
                def _():
                    plgpu.barrier_wait(free)
                p_smem[...] = p.astype(p_smem.dtype)
                plgpu.barrier_arrive(ready)
                weights = (weights + p).astype(do_tiles[0].dtype)  # 16-bit between maps, as the wgmma reads it
            return tuple(_accumulate(acc, weights, do, cfg, registers=True, stage=stages[0])
                         for acc, do in zip(accs, do_tiles, strict=True))

        def keys(accs):  # warpgroup 1
            dp = _matmul(v_smem[0], do_tiles[0].transpose((1, 0)), shape,  # dPᵀ = Σ_c V_c·dO_cᵀ over V's chunks
                         [(v_smem[c], do_tiles[c].transpose((1, 0))) for c in range(1, maps)])
            new = []
            for i, acc in enumerate(accs):
                plgpu.barrier_wait(ready)
                p = _load(p_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
                if not compact:
                    plgpu.barrier_arrive(free)
                ds = score_grad(0, p, dp, _cols(_load(d_tiles[i], col), shape), None)  # cᵢ already in p
                new.append(_accumulate(acc, ds, q_tiles[i], cfg, registers=True, stage=stages[1]))
                if fused:  # these keys' share of dQᵢ = dSᵢ·Kᵢ (dSᵢ read transposed from its tile), added into dQ
                    ds_tile = p_smem if compact else ds_tiles[i]
                    ds_tile[...] = ds.astype(ds_tile.dtype)
                    plgpu.commit_smem()
                    width = dq_tile.shape[-1]
                    for c in range(chunk // width):
                        cols = pl.ds(c * width, width)
                        k_cols = k_smem[i] if width == chunk else k_smem[i].at[:, cols]
                        dq_tile[...] = _matmul(ds_tile.transpose((1, 0)), k_cols, (bq, width)) * cfg.scale
                        rows = pl.ds(q_block(idx[0]) * bq, bq)
                        if cfg.interpret:
                            _copy_out([(dq_tile, dq_refs[i].at[bi, ki, lax.axis_index("tile"), rows, cols])])
                        else:
                            _copy_out([(dq_tile, dq_refs[i].at[bi, ki, rows, cols])], reduction_op="add")
                    if compact:
                        plgpu.barrier_arrive(free)
            return tuple(new)

        return lax.cond(wg == 0, values, keys, accs)

    in_specs = [plgpu.BlockSpec((bq, r.shape[-1]), lambda j: (q_block(j), 0), transforms=_transforms(r.shape[-1],
                                                                                                   r.dtype))
                for r in q_refs]
    in_specs += [plgpu.BlockSpec((bq, chunk), lambda j: (q_block(j), 0), transforms=_transforms(chunk, do_ref.dtype))
                 ] * maps + [plgpu.BlockSpec((bq,), lambda j: (q_block(j),))] * (2 * maps)
    gmem = [r.at[bi, ki] for r in q_refs] + [do_ref.at[bi, ki, :, pl.ds(c * chunk, chunk)] for c in range(maps)]
    gmem += [r.at[bi, ki] for r in (*lse_refs, *d_refs)]
    if cfg.has_seg:
        in_specs.append(plgpu.BlockSpec((bq,), lambda j: (lax.rem(q_block(j), t // bq),)))
        gmem.append(q_seg_ref.at[bi])
    # every step is visible to the tile's keys (causal: from the diagonal on): no step skipped, as the handoff needs
    _pipeline(step, (group * per_head,), in_specs, compute, cfg, 2)(*gmem)


# ------------------------------------------------------------------------------------------------------ the ops

_fused = fused_attention(_forward, _backward_kernels, lambda do, o: jnp.einsum("bhte,bhte->bht", do, o))


def _check_dtype(q):
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"impl 'mosaic_gpu' takes bfloat16 or float16 inputs (wgmma), got {q.dtype}: use 'pallas' "
                         f"or 'xla' for float32")


diff_attention, attention = public_ops(
    _fused, BlockSizes, lambda q, causal: BlockSizes.get_default(q.shape[-1], causal), heads_major=True,
    check_input=_check_dtype)

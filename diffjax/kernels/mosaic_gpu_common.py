"""What the Mosaic GPU forward and backward kernels (`mosaic_gpu_forward.py`, `mosaic_gpu_backward.py`) share: a
launch that hands a kernel its operands, outputs and scratch by name, a pipeline that hands each step its tiles by
name, and the pieces of a kernel body: shared-memory tiles, wgmma products, masks, TMA copies (docs/kernels.md, "The
Mosaic GPU kernel")."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import xla_bridge  # backends_are_initialized: whether PJRT_NPROC can still take effect

from diffjax.kernels.common import KernelConfig

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a jaxlib without Mosaic GPU
    plgpu = None


class Refs(NamedTuple):
    """A kernel's operands by name, in the order a launch passes them (a None or empty field is not passed): each
    map's queries and keys, V, for the backward dO and each map's log-sum-exps and row sums D_i, λ as a row (DIFF;
    `lam_row`), and the query and key segment ids (packed documents)."""

    q: list
    k: list
    v: Any
    do: Any = None
    lse: list = ()
    rowsum: list = ()
    lam: Any = None
    q_seg: Any = None
    k_seg: Any = None


def lam_row(lam, rows: int):
    """λ broadcast to a row of `rows` (a vector loads where a scalar cannot); None for the standard op."""
    return None if lam is None else jnp.broadcast_to(lam.astype(jnp.float32), (rows,))


def row_scratch(wgs: int, rows: int) -> dict:
    """Shared memory for a warpgroup's λ row and query segment ids."""
    return dict(lam_smem=plgpu.SMEM((wgs, rows), jnp.float32), seg_smem=plgpu.SMEM((wgs, rows), jnp.int32))


def rows_in(refs: Refs, lam_smem, seg_smem, bi, q0, rows: int, wg):
    """(gmem, smem) copies of λ's row and the rows' query segment ids, those the call has."""
    return ([] if refs.lam is None else [(refs.lam.at[pl.ds(0, rows)], lam_smem.at[wg])]) + (
        [] if refs.q_seg is None else [(refs.q_seg.at[bi, pl.ds(q0, rows)], seg_smem.at[wg])])


def load(ref, layout):
    """A whole shared-memory vector into registers in `layout` (jax < 0.12 asks for an index: `()`, all of it)."""
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def tile_transforms(cols: int, dtype):
    """Tiling and swizzle of a [rows, cols] shared-memory tile: the widest swizzle a row allows."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def smem_tile(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=tile_transforms(shape[-1], dtype))


def tile_spec(rows: int, cols: int, dtype):
    return plgpu.BlockSpec((rows, cols), lambda j: (j, 0), transforms=tile_transforms(cols, dtype))


def row_spec(rows: int):
    return plgpu.BlockSpec((rows,), lambda j: (j,))


def matmul(a_smem, b_smem, shape, more=()):
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


def accumulate(acc, a, b, cfg: KernelConfig, *, registers: bool = False, stage=None):
    """acc + a·b, a a shared-memory tile or (`registers`) a register tile. On a GPU the wgmma accumulates into acc's
    own registers (`pl.run_state`) and takes a register tile as its left operand, as FlashAttention-3 does; the
    interpreter runs neither, so there a register tile goes through the shared-memory tile `stage` and the product
    into a fresh accumulator."""
    if cfg.interpret:
        return acc + matmul(_stage(stage, a) if registers else a, b, acc.shape)
    a = a.astype(b.dtype) if registers else a

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(run)(plgpu.ACC.init(acc))


def per_row(x, shape):  # a per-row vector broadcast over columns
    return lax.broadcast_in_dim(x, shape, [0])


def per_col(x, shape):  # a per-column vector broadcast over rows
    return lax.broadcast_in_dim(x, shape, [1])


def masked(x, fill, q0, k0, cfg: KernelConfig, q_seg=None, k_seg=None, transposed=False):
    """x with `fill` where a (query, key) pair is not visible, for queries from q0 and keys from k0 (x is [keys,
    queries] when `transposed`). Key padding is masked only where the keys were padded (`common.prepare` pads them to
    a multiple of every tile): a mask term fewer is registers freed in the tightest kernels."""
    shape = x.shape
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    expand_q, expand_k = (per_col, per_row) if transposed else (per_row, per_col)

    def positions(start, dim):  # a vector, compared once broadcast: a thread keeps a few registers, not an int32 tile
        return start + plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=plgpu.Layout.WGMMA.reduce(1 - dim))
    k_pos = functools.cache(lambda: expand_k(positions(k0, k_dim), shape))  # only if used: an unused iota stalls
    masks = [expand_q(positions(q0, q_dim), shape) >= k_pos()] if cfg.causal else []  # Mosaic's layout inference
    masks += [k_pos() < cfg.kv_len] if cfg.kv_len % cfg.blocks.multiple else []
    if q_seg is not None:
        masks.append(expand_q(q_seg, shape) == expand_k(k_seg, shape))
    return jnp.where(functools.reduce(jnp.logical_and, masks), x, fill) if masks else x


def key_blocks(tile_end, block: int, cfg: KernelConfig):
    """How many key blocks the pipeline loads for queries before `tile_end`: up to the last key a query sees (causal;
    traced, a dynamic pipeline grid) and never a block of padding alone."""
    n = -(-cfg.kv_len // block)
    return jnp.minimum(lax.div(tile_end + block - 1, block), n) if cfg.causal else n


def visible(q0, q_rows, k0, cfg: KernelConfig):
    """Whether any key of the block from k0 is visible to the query block [q0, q0 + q_rows): skipped blocks cost a
    barrier, not their matmuls."""
    seen = k0 < cfg.kv_len
    return jnp.logical_and(seen, k0 <= q0 + q_rows - 1) if cfg.causal else seen


def copy_in(pairs, barriers, wg, wgs: int):
    """TMA copies gmem → smem for warpgroup `wg` (of `wgs`), one barrier each, then wait for all."""
    mine = [barriers.at[n * wgs + wg] for n in range(len(pairs))]
    for (src, dst), barrier in zip(pairs, mine, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, barrier)
    for barrier in mine:
        plgpu.barrier_wait(barrier)


def copy_out(pairs, reduction_op=None):
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


def launch(body, name: str, refs: Refs, out_type, scratch: dict, grid, cfg: KernelConfig, wgs: int, *, outs=None):
    """One launch of `body(refs, outs, **scratch)` over `grid` (batch, tile, head) with `wgs` compute warpgroups and a
    memory one: its operands by name (`Refs`); its outputs by name, made as `out_type` (a NamedTuple of
    ShapeDtypeStructs, returned as one of arrays) or given as `outs`, refs a `pl.run_state` aliases; its shared memory
    and barriers by name, allocated in `scratch`'s order (a None entry is not allocated and reaches the body as None).
    `name` (prefixed "diff_" for two maps) names its dumps (experiments/mosaic_gpu_resources.py)."""
    args, in_tree = jax.tree.flatten((refs, outs))
    out_types, out_tree = jax.tree.flatten(out_type)
    scratch_types, scratch_tree = jax.tree.flatten(list(scratch.values()))

    def kernel(*flat):
        made = len(args) + len(out_types)
        refs, given = jax.tree.unflatten(in_tree, flat[:len(args)])
        outs = given if given is not None else jax.tree.unflatten(out_tree, flat[len(args):made])
        body(refs, outs, **dict(zip(scratch, jax.tree.unflatten(scratch_tree, flat[made:]), strict=True)))

    interpret = _interpret_params() if cfg.interpret else None
    kernel.__name__ = f"mgpu_{'diff_' if len(refs.q) == 2 else ''}{name}"
    made = plgpu.kernel(kernel, out_type=out_types, scratch_types=scratch_types, grid=grid,
                        grid_names=("batch", "tile", "head"), num_threads=wgs + 1, thread_name="wg",
                        interpret=interpret, compiler_params=plgpu.CompilerParams(approx_math=True))(*args)
    return jax.tree.unflatten(out_tree, made)


def run_pipeline(step, grid, tiles: dict, compute, cfg: KernelConfig, wgs: int):
    """The warp-specialized pipeline over `grid`: a memory warpgroup streams `tiles` by TMA into `stages` buffers while
    `compute(pipeline)` runs on the compute warpgroups, each step as `step(idx, tiles, carry)`. `tiles` names each
    input: a (BlockSpec, gmem ref) pair, a pair of lists (one tile per map or per chunk of V), or None where the call
    has none; the step receives the tiles by the same names."""
    named = {name: pair for name, pair in tiles.items() if pair is not None}
    specs, tree = jax.tree.flatten([spec for spec, _ in named.values()])
    gmem = tree.flatten_up_to([ref for _, ref in named.values()])

    def body(idx, *tiles_and_carry):
        *flat, carry = tiles_and_carry
        return step(idx, dict(zip(named, jax.tree.unflatten(tree, flat), strict=True)), carry)

    plgpu.emit_pipeline_warp_specialized(
        body, grid=grid, in_specs=specs, memory_registers=24, wg_axis="wg", num_compute_wgs=wgs,
        max_concurrent_steps=cfg.blocks.stages, compute_context=compute)(*gmem)

"""The Mosaic GPU forward: both online softmaxes in one pass over the K/V tiles, each tile loaded once, the float32
epilogue `acc1/l1 − λ·acc2/l2`; its two compute warpgroups on their own query rows (`_rows_kernel`) or on the same
rows, one map each (`_by_map_kernel`, `BlockSizes.forward == "maps"`). docs/kernels.md, "The Mosaic GPU kernel"."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diffjax.kernels.common import LOG2E, NEG_INF, KernelConfig, combine
from diffjax.kernels.mosaic_gpu_common import (
    Refs,
    accumulate,
    copy_in,
    copy_out,
    key_blocks,
    lam_row,
    launch,
    load,
    masked,
    matmul,
    per_row,
    pl,
    plgpu,
    row_scratch,
    row_spec,
    rows_in,
    run_pipeline,
    smem_tile,
    tile_spec,
    visible,
)


class Outputs(NamedTuple):
    """The forward's outputs by name: o, and with residuals each map's O_i and log-sum-exp."""

    o: Any
    res: list = ()
    lse: list = ()


def forward(queries, keys, v, lam, seg, cfg: KernelConfig, residuals: bool):
    """Heads-major [B, H, T, d] inputs -> (o, [O_i], [lse_i]) as `pallas_gpu._forward`."""
    maps, dtype = len(queries), queries[0].dtype
    b, h, t, d = queries[0].shape
    n_kv, e = keys[0].shape[1], v.shape[-1]
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    ev = min(e, blk.v_chunk)
    res_dtype = jnp.dtype(cfg.residual_dtype or dtype)
    n = maps if residuals else 0
    out_type = Outputs(jax.ShapeDtypeStruct((b, h, t, e), dtype), [jax.ShapeDtypeStruct((b, h, t, e), res_dtype)] * n,
                       [jax.ShapeDtypeStruct((b, h, t), jnp.float32)] * n)
    q_seg, k_seg = seg or (None, None)
    refs = Refs(queries, keys, v, lam=lam_row(lam, bq), q_seg=q_seg, k_seg=k_seg)
    if maps == 2 and blk.forward == "maps":
        # outputs are staged in Q's tiles (Q is no longer read) where they fit them: V's half as wide as Q (a padded
        # d < 64 has V narrower), the residuals in the inputs' dtype; else in tiles of their own
        half = e // 2
        scratch = dict(q_smem=smem_tile((2, bq, d), dtype), p_smem=smem_tile((4, bq, bk), dtype),
                       o_stage=None if half == d else smem_tile((2, bq, half), dtype),
                       res_stage=smem_tile((2, bq, half), res_dtype) if residuals and res_dtype != dtype else None,
                       alpha_smem=plgpu.SMEM((2, 2, bq), jnp.float32), l_smem=plgpu.SMEM((2, 2, bq), jnp.float32),
                       **row_scratch(2, bq), copies=plgpu.Barrier(num_barriers=6),
                       shared=plgpu.Barrier(num_arrivals=2, num_barriers=3))
        kernel = functools.partial(_by_map_kernel, cfg=cfg, group=h // n_kv)
        out = launch(kernel, "fwd", refs, out_type, scratch, (b, t // bq, h), cfg, 2)
    else:
        scratch = dict(q_smem=smem_tile((maps, wgs, bq, d), dtype), p_smem=smem_tile((wgs, bq, bk), dtype),
                       o_smem=smem_tile((wgs, bq, ev), res_dtype), lse_smem=plgpu.SMEM((maps, wgs, bq), jnp.float32),
                       **row_scratch(wgs, bq), barriers=plgpu.Barrier(num_barriers=(maps + 2) * wgs))
        kernel = functools.partial(_rows_kernel, cfg=cfg, group=h // n_kv, ev=ev)
        out = launch(kernel, "fwd", refs, out_type, scratch, (b, t // (wgs * bq), h * (e // ev)), cfg, wgs)
    return out.o, out.res, out.lse


def _rows_kernel(refs: Refs, out: Outputs, *, q_smem, p_smem, o_smem, lse_smem, lam_smem, seg_smem, barriers,
                 cfg: KernelConfig, group: int, ev: int):
    """Each compute warpgroup its own query rows, both maps; V's columns in chunks of `ev`, one launch each."""
    maps = len(refs.q)
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    chunks = refs.v.shape[-1] // ev
    bi, head_chunk, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    hi, c = lax.div(head_chunk, chunks), lax.rem(head_chunk, chunks)
    q0 = lax.axis_index("tile") * (wgs * bq) + wg * bq
    row = plgpu.Layout.WGMMA.reduce(1)

    def compute(pipeline):
        q_in = [(r.at[bi, hi, pl.ds(q0, bq)], q_smem.at[i, wg]) for i, r in enumerate(refs.q)]
        copy_in(q_in + rows_in(refs, lam_smem, seg_smem, bi, q0, bq, wg), barriers, wg, wgs)
        acc0 = plgpu.layout_cast(jnp.zeros((bq, ev), jnp.float32), plgpu.Layout.WGMMA)
        m0 = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), row)
        l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        states = pipeline(((acc0, m0, l0),) * maps)
        outs = [acc / per_row(l, acc.shape) for acc, _, l in states]  # noqa: E741
        lam = None if refs.lam is None else per_row(load(lam_smem.at[wg], row), (bq, ev))
        dst = (bi, hi, pl.ds(q0, bq), pl.ds(c * ev, ev))
        o_smem.at[wg][...] = combine(outs, lam).astype(o_smem.dtype)  # float32 epilogue, one cast
        copy_out([(o_smem.at[wg], out.o.at[dst])])
        for o_i, res_ref in zip(outs if out.res else [], out.res, strict=True):
            o_smem.at[wg][...] = o_i.astype(o_smem.dtype)
            copy_out([(o_smem.at[wg], res_ref.at[dst])])
        if out.lse:
            for i, (_, m, l) in enumerate(states):  # noqa: E741
                lse_smem.at[i, wg][...] = m + jnp.log2(l)

            @pl.when(c == 0)
            def _():
                copy_out([(lse_smem.at[i, wg], r.at[bi, hi, pl.ds(q0, bq)]) for i, r in enumerate(out.lse)])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, states):
        k0 = idx[0] * bk
        shape = (bq, bk)

        def visit(states):
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = load(seg_smem.at[wg], row)
                k_seg = load(tiles["k_seg"], plgpu.Layout.WGMMA.reduce(0))
            new = []
            for i, (acc, m, l) in enumerate(states):  # noqa: E741
                s = matmul(q_smem.at[i, wg], tiles["k"][i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                s = masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - per_row(m_new, shape))
                acc = accumulate(acc * per_row(alpha, acc.shape), p, tiles["v"], cfg, registers=True,
                                 stage=p_smem.at[wg])
                new.append((acc, m_new, l * alpha + p.sum(axis=1)))
            return tuple(new)

        return lax.cond(visible(q0, bq, k0, cfg), visit, lambda states: states, states)

    kv = lax.div(hi, group)
    tiles = {"k": ([tile_spec(bk, r.shape[-1], r.dtype) for r in refs.k], [r.at[bi, kv] for r in refs.k]),
             "v": (tile_spec(bk, ev, refs.v.dtype), refs.v.at[bi, kv, :, pl.ds(c * ev, ev)]),
             "k_seg": (row_spec(bk), refs.k_seg.at[bi]) if cfg.has_seg else None}
    tile_end = (lax.axis_index("tile") + 1) * (wgs * bq)
    run_pipeline(step, (key_blocks(tile_end, bk, cfg),), tiles, compute, cfg, wgs)


def _by_map_kernel(refs: Refs, out: Outputs, *, q_smem, p_smem, o_stage, res_stage, alpha_smem, l_smem, lam_smem,
                   seg_smem, copies, shared, cfg: KernelConfig, group: int):
    """DIFF's forward with the two compute warpgroups on the same query rows, one map's softmax each: warpgroup w
    computes S_w and its online softmax, shares P_w and its rescale α_w through shared memory, and accumulates both
    maps' P·V for its half of V's 2d columns. The logits once, no accumulator twice: 12 units of h·N²·d, two float32
    [rows, d] accumulators a thread (docs/kernels.md, "The Mosaic GPU kernel")."""
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    half = refs.v.shape[-1] // 2
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
        for i, r in enumerate(refs.q):
            @pl.when(wg == i)
            def _(r=r, i=i):
                copy_in([(r.at[bi, hi, pl.ds(q0, bq)], q_smem.at[i])] + rows_in(
                    refs, lam_smem, seg_smem, bi, q0, bq, wg), copies, wg, 2)
        zeros = plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), plgpu.Layout.WGMMA)
        m0 = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), row)
        l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        accs, m, l = pipeline(((zeros, zeros), m0, l0))  # noqa: E741
        l_smem.at[0, wg][...] = l
        exchange(2)
        ls = [load(l_smem.at[0, i], row) for i in range(2)]
        outs = [acc / per_row(li, acc.shape) for acc, li in zip(accs, ls, strict=True)]
        lam = per_row(load(lam_smem.at[wg], row), (bq, half))
        cols = (bi, hi, pl.ds(q0, bq), pl.ds(wg * half, half))
        stage = (q_smem if o_stage is None else o_stage).at[wg]
        stage[...] = combine(outs, lam).astype(stage.dtype)  # float32 epilogue, one cast
        copy_out([(stage, out.o.at[cols])])
        stage = stage if res_stage is None else res_stage.at[wg]
        for o_i, res_ref in zip(outs if out.res else [], out.res, strict=True):
            stage[...] = o_i.astype(stage.dtype)
            copy_out([(stage, res_ref.at[cols])])
        for i, r in enumerate(out.lse):
            @pl.when(wg == i)
            def _(r=r):
                l_smem.at[1, wg][...] = m + jnp.log2(l)
                copy_out([(l_smem.at[1, wg], r.at[bi, hi, pl.ds(q0, bq)])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, state):
        accs, m, l = state  # noqa: E741
        k0 = idx[0] * bk
        shape = (bq, bk)
        slot = lax.rem(idx[0], 2)  # P and α double-buffered: a warpgroup writes slot j + 2 after the other's step j
        # refs are indexed inside the branches: a transformed ref closed over from outside does not lower
        s = by_map([lambda i=i: matmul(q_smem.at[i], tiles["k"][i].transpose((1, 0)), shape)
                    for i in range(2)]) * (cfg.scale * LOG2E)
        q_seg = k_seg = None
        if cfg.has_seg:
            q_seg = load(seg_smem.at[wg], row)
            k_seg = load(tiles["k_seg"], plgpu.Layout.WGMMA.reduce(0))
        s = masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - per_row(m_new, shape))
        # P of (slot, map) at 2·slot + map: a traced index (a literal one inside `pl.run_state` does not lower)
        p_smem.at[2 * slot + wg][...] = p.astype(p_smem.dtype)
        alpha_smem.at[slot, wg][...] = alpha
        exchange(slot)
        new = []
        for i, acc in enumerate(accs):  # P_i·V for this warpgroup's half of V's columns
            alpha_i = load(alpha_smem.at[slot, i], row)
            acc = acc * per_row(alpha_i, acc.shape)
            new.append(by_map([lambda acc, i=i, v=v: accumulate(acc, p_smem.at[2 * slot + i], v, cfg)
                               for v in tiles["v"]], acc))
        return tuple(new), m_new, l * alpha + p.sum(axis=1)

    kv = lax.div(hi, group)
    tiles = {"k": ([tile_spec(bk, r.shape[-1], r.dtype) for r in refs.k], [r.at[bi, kv] for r in refs.k]),
             "v": ([tile_spec(bk, half, refs.v.dtype)] * 2, [refs.v.at[bi, kv, :, pl.ds(c * half, half)]
                                                            for c in range(2)]),
             "k_seg": (row_spec(bk), refs.k_seg.at[bi]) if cfg.has_seg else None}
    # every key block of the pipeline is visible to the rows' last query (no skipped step: the exchange needs both)
    run_pipeline(step, (key_blocks(q0 + bq, bk, cfg),), tiles, compute, cfg, 2)

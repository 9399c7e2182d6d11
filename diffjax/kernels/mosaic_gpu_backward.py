"""The Mosaic GPU backward: a dQ kernel (dP = dO·Vᵀ once per tile, shared by both maps; by rows `_dq_kernel`, or by
map `_dq_by_map_kernel`) and a dK/dV kernel (dV = (P1 − λP2)ᵀ·dO once, the GQA group summed in-kernel; by rows
`_dkv_kernel`, dK and dV in one launch or two, or by output `_dkv_pair_kernel`), the combined backward of
docs/kernels.md; or, with `dkv="fused"`, dQ formed in the dK/dV kernel and summed over key tiles in float32 by TMA
reduce-adds, as FlashAttention-3 does (docs/kernels.md, "The Mosaic GPU kernel")."""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diffjax.kernels.common import LOG2E, NEG_INF, KernelConfig, combine, score_grad, weighted
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
    per_col,
    per_row,
    pl,
    plgpu,
    row_scratch,
    row_spec,
    rows_in,
    run_pipeline,
    smem_tile,
    tile_spec,
    tile_transforms,
    visible,
)


class Grads(NamedTuple):
    """A backward kernel's outputs by name, in the order a launch passes them: each map's dK, dV, each map's dQ."""

    dk: list = ()
    dv: Any = None
    dq: list = ()


def backward(queries, keys, v, lam, seg, do, lses, rowsums, cfg: KernelConfig):
    """-> ([dq_i], [dk_i], dv) for heads-major inputs, one map or two (as `mosaic_gpu_forward.forward`)."""
    maps, dtype = len(queries), queries[0].dtype
    b, h, t, d = queries[0].shape
    n_kv, s, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    blk = cfg.blocks
    wgs, group = blk.compute_wgs, h // n_kv
    lam = lam_row(lam, max(blk.block_q, blk.block_q_dkv))
    q_seg, k_seg = seg or (None, None)

    bq, bk = blk.block_q, blk.block_k
    dq_type = Grads(dq=[jax.ShapeDtypeStruct(q.shape, dtype) for q in queries])
    refs = Refs(queries, keys, v, do=do, lse=lses, rowsum=rowsums, lam=lam, q_seg=q_seg, k_seg=k_seg)
    pair = blk.dkv in ("pair", "fused") and e == maps * d  # (the standard op with V wider than Q takes the split)
    # its reduce-adds sum dQ in the order the tiles finish, so XLA's deterministic mode (cuDNN's attention backward
    # obeys it too) takes dQ's own kernel
    fused = pair and blk.dkv == "fused" and "--xla_gpu_deterministic_ops=true" not in os.environ.get("XLA_FLAGS", "")
    if fused:
        d_queries = None  # dQ comes out of the dK/dV kernel
    elif maps == 2 and blk.dq == "maps":
        scratch = dict(q_smem=smem_tile((2, bq, d), dtype), do_smem=smem_tile((bq, e), dtype),
                       dp_smem=plgpu.SMEM((bq, bk), jnp.float32),
                       stage=smem_tile((2, bq, bk), dtype) if cfg.interpret else None,  # register tiles', interpret
                       stat_smem=plgpu.SMEM((2, 2, bq), jnp.float32), **row_scratch(2, bq),
                       copies=plgpu.Barrier(num_barriers=10), shared=plgpu.Barrier(num_arrivals=2, num_barriers=2))
        d_queries = launch(functools.partial(_dq_by_map_kernel, cfg=cfg, group=group), "dq", refs, dq_type,
                           scratch, (b, t // bq, h), cfg, 2).dq
    else:
        scratch = dict(q_smem=smem_tile((maps, wgs, bq, d), dtype), do_smem=smem_tile((wgs, bq, e), dtype),
                       ds_smem=smem_tile((wgs, bq, bk), dtype), stat_smem=plgpu.SMEM((2 * maps, wgs, bq), jnp.float32),
                       **row_scratch(wgs, bq), barriers=plgpu.Barrier(num_barriers=(3 * maps + 3) * wgs))
        d_queries = launch(functools.partial(_dq_kernel, cfg=cfg, group=group), "dq", refs, dq_type, scratch,
                           (b, t // (wgs * bq), h), cfg, wgs).dq

    # dK/dV: each compute warpgroup (a pair with dkv="pair") owns block_k_dkv keys of one kv head and walks the query
    # rows of its GQA group (heads-major, the group's heads are contiguous rows: [B, K, g·T, ·]).
    bq, bk = blk.block_q_dkv, blk.block_k_dkv
    flat = lambda x: x.reshape(b, n_kv, group * t, *x.shape[3:])  # noqa: E731
    refs = Refs([*map(flat, queries)], keys, v, do=flat(do), lse=[*map(flat, lses)], rowsum=[*map(flat, rowsums)],
                lam=lam, q_seg=q_seg, k_seg=k_seg)
    grads_type = Grads([jax.ShapeDtypeStruct(k.shape, dtype) for k in keys], jax.ShapeDtypeStruct(v.shape, dtype))
    if pair:
        # K and V chunks (and dS of each map) as separate tiles: a literal index into a shared tile does not lower
        # inside `pl.run_state`; with `fused` the dS tiles and a float32 dQ tile for the partial sums. Above d = 64
        # these do not fit beside the pipeline's tiles (262 KiB of 227), so there (`compact`) P is handed over in 16
        # bits, each dSᵢ goes through P's tile, and dQ through one [rows, 64] float32 tile, a column half at a time
        compact = fused and d > 64
        scratch = dict(k_smem=[smem_tile((bk, d), dtype) for _ in range(maps)],
                       v_smem=[smem_tile((bk, d), dtype) for _ in range(maps)],
                       ds_smem=[smem_tile((bk, bq), dtype) for _ in range(maps)] if fused and not compact else None,
                       dq_smem=plgpu.SMEM((bq, min(d, 64)), jnp.float32) if fused else None,
                       p_smem=smem_tile((bk, bq), dtype) if compact else plgpu.SMEM((bk, bq), jnp.float32),
                       stage=smem_tile((2, bk, bq), dtype) if cfg.interpret else None,  # register tiles', interpret
                       lam_smem=plgpu.SMEM((bq,), jnp.float32), seg_smem=plgpu.SMEM((bk,), jnp.int32),
                       copies=plgpu.Barrier(num_barriers=2 * (maps + 2)), handoff=plgpu.Barrier(num_barriers=2),
                       done=plgpu.Barrier(num_arrivals=2))
        kernel = functools.partial(_dkv_pair_kernel, cfg=cfg, group=group, compact=compact)
        if not fused:
            grads = launch(kernel, "dkv", refs, grads_type, scratch, (b, s // bk, n_kv), cfg, 2)
            return d_queries, grads.dk, grads.dv
        # dQ summed over the key tiles in float32 in place (zeros in, TMA reduce-adds); the interpreter has no TMA
        # reduction, so there each key tile's partial goes apart and XLA sums them
        dq_shape = (b, n_kv, *((s // bk,) if cfg.interpret else ()), group * t, d)
        zeros = jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), grads_type)._replace(
            dq=[jnp.zeros(dq_shape, jnp.float32)] * maps)
        grads = pl.run_state(lambda outs: launch(kernel, "dkv", refs, (), scratch, (b, s // bk, n_kv), cfg, 2,
                                                 outs=outs))(zeros)
        d_queries = [(x.sum(2) if cfg.interpret else x).reshape(queries[0].shape).astype(dtype) for x in grads.dq]
        return d_queries, grads.dk, grads.dv
    # "rows": dK and dV in one launch; "split" (or "pair" refused): one launch each
    parts = [grads_type] if blk.dkv == "rows" else [Grads(dk=grads_type.dk), Grads(dv=grads_type.dv)]
    scratch = dict(k_smem=smem_tile((maps, wgs, bk, d), dtype), v_smem=smem_tile((wgs, bk, e), dtype),
                   p_smem=smem_tile((wgs, bk, bq), dtype), lam_smem=plgpu.SMEM((wgs, bq), jnp.float32),
                   seg_smem=plgpu.SMEM((wgs, bk), jnp.int32), barriers=plgpu.Barrier(num_barriers=(maps + 3) * wgs))
    grads = [launch(functools.partial(_dkv_kernel, cfg=cfg, group=group),
                    "d" + "k" * bool(part.dk) + "v" * (part.dv is not None), refs, part, scratch,
                    (b, s // (wgs * bk), n_kv), cfg, wgs) for part in parts]
    return d_queries, grads[0].dk, grads[-1].dv


def _dq_kernel(refs: Refs, out: Grads, *, q_smem, do_smem, ds_smem, stat_smem, lam_smem, seg_smem, barriers,
               cfg: KernelConfig, group: int):
    """dQ with each compute warpgroup on its own query rows, both maps."""
    maps = len(refs.q)
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q, blk.block_k, blk.compute_wgs
    bi, hi, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    q0 = lax.axis_index("tile") * (wgs * bq) + wg * bq
    row = plgpu.Layout.WGMMA.reduce(1)
    q_rows = pl.ds(q0, bq)

    def compute(pipeline):
        pairs = [(r.at[bi, hi, q_rows], q_smem.at[i, wg]) for i, r in enumerate(refs.q)]
        pairs += [(refs.do.at[bi, hi, q_rows], do_smem.at[wg])]
        pairs += [(r.at[bi, hi, q_rows], stat_smem.at[n, wg]) for n, r in enumerate([*refs.lse, *refs.rowsum])]
        pairs += rows_in(refs, lam_smem, seg_smem, bi, q0, bq, wg)
        copy_in(pairs, barriers, wg, wgs)
        zeros = plgpu.layout_cast(jnp.zeros((bq, refs.q[0].shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        dqs = pipeline((zeros,) * maps)
        for i, (dq, dq_ref) in enumerate(zip(dqs, out.dq, strict=True)):
            q_smem.at[i, wg][...] = (dq * cfg.scale).astype(q_smem.dtype)  # Q is no longer read: its tile stages dQ
            copy_out([(q_smem.at[i, wg], dq_ref.at[bi, hi, q_rows])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, dqs):
        k0 = idx[0] * bk
        shape = (bq, bk)

        def visit(dqs):
            # per-row statistics stay vectors, broadcast where used: a broadcast [rows, keys] tile held across the
            # step costs a thread 32 registers
            stats = [load(stat_smem.at[n, wg], row) for n in range(2 * maps)]
            lses, rowsums = stats[:maps], stats[maps:]
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = load(seg_smem.at[wg], row)
                k_seg = load(tiles["k_seg"], plgpu.Layout.WGMMA.reduce(0))
            dp = matmul(do_smem.at[wg], tiles["v"].transpose((1, 0)), shape)  # once for every map
            lam = None if refs.lam is None else load(lam_smem.at[wg], row)
            new = []
            for i, (dq, k_tile) in enumerate(zip(dqs, tiles["k"], strict=True)):  # one map's tiles live at a time
                s = matmul(q_smem.at[i, wg], k_tile.transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                # P_i from the saved log-sum-exp, masked per map (a mask kept across dP costs registers)
                p = masked(jnp.exp2(s - per_row(lses[i], shape)), 0.0, q0, k0, cfg, q_seg, k_seg)
                ds = score_grad(i, p, dp, per_row(rowsums[i], shape), None if lam is None else per_row(lam, shape))
                new.append(accumulate(dq, ds, k_tile, cfg, registers=True, stage=ds_smem.at[wg]))
            return tuple(new)

        if wgs == 1:  # every step of the pipeline is visible to the one warpgroup's rows
            return visit(dqs)
        return lax.cond(visible(q0, bq, k0, cfg), visit, lambda dqs: dqs, dqs)

    tile_end = (lax.axis_index("tile") + 1) * (wgs * bq)
    _dq_pipeline(step, compute, refs, bi, lax.div(hi, group), tile_end, cfg, wgs)


def _dq_pipeline(step, compute, refs: Refs, bi, kv, tile_end, cfg: KernelConfig, wgs: int):
    """dQ's pipeline: the K and V tiles of kv head `kv` (and the key ids) up to the last key visible before
    `tile_end`."""
    bk = cfg.blocks.block_k
    tiles = {"k": ([tile_spec(bk, r.shape[-1], r.dtype) for r in refs.k], [r.at[bi, kv] for r in refs.k]),
             "v": (tile_spec(bk, refs.v.shape[-1], refs.v.dtype), refs.v.at[bi, kv]),
             "k_seg": (row_spec(bk), refs.k_seg.at[bi]) if cfg.has_seg else None}
    run_pipeline(step, (key_blocks(tile_end, bk, cfg),), tiles, compute, cfg, wgs)


def _dq_by_map_kernel(refs: Refs, out: Grads, *, q_smem, do_smem, dp_smem, stage, stat_smem, lam_smem, seg_smem,
                      copies, shared, cfg: KernelConfig, group: int):
    """DIFF's dQ with the two compute warpgroups on the same query rows, one map each: warpgroup w accumulates
    dQ_w += dS_w·K_w, computing dP = dO·Vᵀ for half of each tile's keys and sharing it through shared memory, so dP
    is formed once and a thread holds one float32 [rows, d] accumulator (two do not fit at d = 128): 12 units."""
    written, read = shared.at[0], shared.at[1]  # both halves of dP are in the tile; both warpgroups have read it
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    half = bk // 2
    bi, hi, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
    q0 = lax.axis_index("tile") * bq
    row = plgpu.Layout.WGMMA.reduce(1)
    q_rows = pl.ds(q0, bq)

    def by_map(fns, *args):  # the warpgroup's own map's branch (as `mosaic_gpu_forward._by_map_kernel`)
        return lax.cond(wg == 0, fns[0], fns[1], *args)

    def compute(pipeline):
        mine = []  # each warpgroup copies its map's rows; warpgroup 0 also dO and the query ids, which both read
        for i in range(2):
            pairs = [(refs.q[i].at[bi, hi, q_rows], q_smem.at[i]), (refs.lse[i].at[bi, hi, q_rows], stat_smem.at[0, i]),
                     (refs.rowsum[i].at[bi, hi, q_rows], stat_smem.at[1, i]),
                     (refs.lam.at[pl.ds(0, bq)], lam_smem.at[i])]
            if i == 0:
                pairs.append((refs.do.at[bi, hi, q_rows], do_smem))
                pairs += [] if refs.q_seg is None else [(refs.q_seg.at[bi, q_rows], seg_smem.at[0])]
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
        zeros = plgpu.layout_cast(jnp.zeros((bq, refs.q[0].shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        dq = pipeline(zeros)
        q_smem.at[wg][...] = (dq * cfg.scale).astype(q_smem.dtype)  # Q is no longer read: its tile stages dQ
        for i, dq_ref in enumerate(out.dq):
            pl.when(wg == i)(lambda dq_ref=dq_ref: copy_out([(q_smem.at[wg], dq_ref.at[bi, hi, q_rows])]))
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, dq):
        k0 = idx[0] * bk
        shape = (bq, bk)
        def dp_half(c):  # dP for keys [c·half, (c + 1)·half) of the tile, into the one shared tile once both have read
            part = matmul(do_smem, tiles["v"].at[pl.ds(c * half, half)].transpose((1, 0)), (bq, half))
            pl.when(idx[0] > 0)(lambda: plgpu.barrier_wait(read))
            dp_smem.at[:, pl.ds(c * half, half)][...] = part
        by_map([functools.partial(dp_half, c) for c in range(2)])
        plgpu.barrier_arrive(written)
        s = by_map([lambda i=i: matmul(q_smem.at[i], tiles["k"][i].transpose((1, 0)), shape) for i in range(2)])
        q_seg = load(seg_smem.at[0], row) if cfg.has_seg else None
        k_seg = load(tiles["k_seg"], plgpu.Layout.WGMMA.reduce(0)) if cfg.has_seg else None
        lse, rowsum = (load(stat_smem.at[n, wg], row) for n in range(2))
        p = masked(jnp.exp2(s * (cfg.scale * LOG2E) - per_row(lse, shape)), 0.0, q0, k0, cfg, q_seg, k_seg)  # P_w
        lam = load(lam_smem.at[wg], row)
        c = by_map([lambda i=i: weighted(i, jnp.ones_like(lam), lam) for i in range(2)])  # 1 or −λ
        plgpu.barrier_wait(written)
        dp = load(dp_smem, plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(read)
        ds = score_grad(0, p, dp, per_row(rowsum, shape), None) * per_row(c, shape)
        return by_map([lambda dq, i=i: accumulate(dq, ds, tiles["k"][i], cfg, registers=True,
                                                  stage=None if stage is None else stage.at[i])
                       for i in range(2)], dq)

    # every key block of the pipeline is visible to the rows' last query (no skipped step: the exchange needs both)
    _dq_pipeline(step, compute, refs, bi, lax.div(hi, group), q0 + bq, cfg, 2)


def _q_tiles(refs: Refs, q_block, bi, ki, t: int, cfg: KernelConfig, do_chunks: int | None = None) -> dict:
    """The dK/dV pipeline's tiles from kv head `ki`'s group: query block `q_block(j)` of each map's queries, of dO
    (whole, or in `do_chunks` column chunks), of the maps' log-sum-exps and row sums, and the query ids (every head
    of the group has the batch row's)."""
    bq, maps = cfg.blocks.block_q_dkv, len(refs.q)
    chunk = refs.do.shape[-1] // (do_chunks or 1)

    def spec(cols, dtype):
        return plgpu.BlockSpec((bq, cols), lambda j: (q_block(j), 0), transforms=tile_transforms(cols, dtype))
    stat = plgpu.BlockSpec((bq,), lambda j: (q_block(j),))
    do = [refs.do.at[bi, ki]] if do_chunks is None else [refs.do.at[bi, ki, :, pl.ds(c * chunk, chunk)]
                                                         for c in range(do_chunks)]
    return {"q": ([spec(r.shape[-1], r.dtype) for r in refs.q], [r.at[bi, ki] for r in refs.q]),
            "do": ([spec(chunk, refs.do.dtype)] * len(do), do),
            "lse": ([stat] * maps, [r.at[bi, ki] for r in refs.lse]),
            "rowsum": ([stat] * maps, [r.at[bi, ki] for r in refs.rowsum]),
            "q_seg": (plgpu.BlockSpec((bq,), lambda j: (lax.rem(q_block(j), t // bq),)), refs.q_seg.at[bi])
            if cfg.has_seg else None}


def _dkv_kernel(refs: Refs, out: Grads, *, k_smem, v_smem, p_smem, lam_smem, seg_smem, barriers, cfg: KernelConfig,
                group: int):
    """dK and dV (or those of `out`: dK alone, dV alone) with each compute warpgroup on its own key rows."""
    maps, want_dk, want_dv = len(refs.q), bool(out.dk), out.dv is not None
    blk = cfg.blocks
    bq, bk, wgs = blk.block_q_dkv, blk.block_k_dkv, blk.compute_wgs
    t = refs.q[0].shape[2] // group
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
    d, e = refs.k[0].shape[-1], refs.v.shape[-1]
    shape = (bk, bq)  # tiles transposed: [keys, queries], so dV and dK accumulate with the tile as wgmma's lhs

    def compute(pipeline):
        pairs = [(r.at[bi, ki, k_rows], k_smem.at[i, wg]) for i, r in enumerate(refs.k)]
        pairs += [(refs.v.at[bi, ki, k_rows], v_smem.at[wg])]
        pairs += [] if refs.lam is None else [(refs.lam.at[pl.ds(0, bq)], lam_smem.at[wg])]
        pairs += [] if refs.k_seg is None else [(refs.k_seg.at[bi, k_rows], seg_smem.at[wg])]
        copy_in(pairs, barriers, wg, wgs)
        acc = lambda n: plgpu.layout_cast(jnp.zeros((bk, n), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
        dks, dv = pipeline(((acc(d),) * maps if want_dk else (), acc(e) if want_dv else None))
        # K and V are no longer read: their tiles stage dK and dV
        results = [(dk * cfg.scale, r, k_smem.at[i, wg]) for i, (dk, r) in enumerate(zip(dks, out.dk, strict=True))]
        results += [(dv, out.dv, v_smem.at[wg])] if want_dv else []
        for x, ref, stage in results:
            stage[...] = x.astype(stage.dtype)
            copy_out([(stage, ref.at[bi, ki, k_rows])])
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, carry):
        (do_tile,) = tiles["do"]
        q0 = lax.rem(q_block(idx[0]), t // bq) * bq

        def visit(carry):
            dks, dv = carry
            # vectors, broadcast where used (as in the dQ kernel)
            lses, rowsums = [load(r, col) for r in tiles["lse"]], [load(r, col) for r in tiles["rowsum"]]
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = load(tiles["q_seg"], col)
                k_seg = load(seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
            ps = []
            for i in range(maps):  # Pᵢᵀ from Sᵢᵀ = Kᵢ·Qᵢᵀ and the saved log-sum-exps
                s = matmul(k_smem.at[i, wg], tiles["q"][i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                ps.append(masked(jnp.exp2(s - per_col(lses[i], shape)), 0.0, q0, k0, cfg, q_seg, k_seg,
                                 transposed=True))
            lam = None if refs.lam is None else per_col(load(lam_smem.at[wg], col), shape)
            if want_dv:  # dV += (P1 − λP2)ᵀ·dO, once for both maps
                dv = accumulate(dv, combine(ps, lam), do_tile, cfg, registers=True, stage=p_smem.at[wg])
            if want_dk:  # dPᵀ = V·dOᵀ once; dKᵢ += dSᵢᵀ·Qᵢ
                dp = matmul(v_smem.at[wg], do_tile.transpose((1, 0)), shape)
                dks = tuple(accumulate(dk, score_grad(i, ps[i], dp, per_col(rowsums[i], shape), lam), q_tile, cfg,
                                       registers=True, stage=p_smem.at[wg])
                            for i, (dk, q_tile) in enumerate(zip(dks, tiles["q"], strict=True)))
            return dks, dv

        return lax.cond(visible(q0, bq, k0, cfg), visit, lambda carry: carry, carry)

    run_pipeline(step, (group * per_head,), _q_tiles(refs, q_block, bi, ki, t, cfg), compute, cfg, wgs)


def _dkv_pair_kernel(refs: Refs, out: Grads, *, k_smem, v_smem, ds_smem, dq_smem, p_smem, stage, lam_smem, seg_smem,
                     copies, handoff, done, cfg: KernelConfig, group: int, compact: bool):
    """dK/dV with two compute warpgroups on the same keys, split by output. Warpgroup 0 forms Pᵢᵀ (Sᵢᵀ = Kᵢ·Qᵢᵀ and
    the saved log-sum-exps) and accumulates dV += (P1 − λP2)ᵀ·dO; warpgroup 1 forms dPᵀ = V·dOᵀ and accumulates
    dKᵢ += dSᵢᵀ·Qᵢ, taking each cᵢ·Pᵢᵀ (c = 1, −λ) from warpgroup 0 through one float32 shared-memory tile. Each holds
    `maps` float32 [keys, d] accumulators (dV in column chunks of d), so d = 128 fits a thread's registers where one
    warpgroup holding dK1, dK2 and dV does not: 16 units of h·N²·d in one launch. Fused (`out.dq`, FlashAttention-3's
    backward): warpgroup 1 also forms these keys' share of each dQᵢ = dSᵢ·Kᵢ and adds it into a float32 dQ in global
    memory (a TMA reduce-add), so no dQ kernel forms S and dP again: 20 units, the arithmetic's. `compact` (fused at
    d > 64, for shared memory): Pᵢ handed over in 16 bits, dSᵢ written into its tile (released once dQ's product has
    read it), dQ added in 64-column halves."""
    maps, fused = len(refs.q), bool(out.dq)
    stages = [stage.at[w] for w in range(2)] if stage is not None else [None, None]  # each warpgroup its own
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    t = refs.q[0].shape[2] // group
    chunk = refs.v.shape[-1] // maps  # = d
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
            pairs = [(r.at[bi, ki, k_rows], k_smem[i]) for i, r in enumerate(refs.k)]
            pairs += [] if refs.lam is None else [(refs.lam.at[pl.ds(0, bq)], lam_smem)]
            pairs += [] if refs.k_seg is None else [(refs.k_seg.at[bi, k_rows], seg_smem)]
            copy_in(pairs, copies, 0, 2)

        @pl.when(wg == 1)  # V for dP, in the column chunks dV is kept in
        def _():
            copy_in([(refs.v.at[bi, ki, k_rows, pl.ds(c * chunk, chunk)], v_smem[c]) for c in range(maps)],
                    copies, 1, 2)

        zeros = plgpu.layout_cast(jnp.zeros((bk, chunk), jnp.float32), plgpu.Layout.WGMMA)
        accs = pipeline((zeros,) * maps)
        plgpu.barrier_arrive(done)  # both are done reading K and V, whose tiles now stage the results
        plgpu.barrier_wait(done)

        def store(accs, stages, outs):
            for acc, tile, (ref, cols) in zip(accs, stages, outs, strict=True):
                tile[...] = acc.astype(tile.dtype)
                copy_out([(tile, ref.at[bi, ki, k_rows, cols])])
        pl.when(wg == 0)(lambda: store(accs, v_smem, [(out.dv, pl.ds(c * chunk, chunk)) for c in range(maps)]))
        pl.when(wg == 1)(lambda: store([a * cfg.scale for a in accs], k_smem, [(r, slice(None)) for r in out.dk]))
        plgpu.wait_smem_to_gmem(0)

    def step(idx, tiles, accs):
        q_tiles, do_tiles = tiles["q"], tiles["do"]
        q0 = lax.rem(q_block(idx[0]), t // bq) * bq

        def values(accs):  # warpgroup 0
            q_seg = k_seg = None
            if cfg.has_seg:
                q_seg = load(tiles["q_seg"], col)
                k_seg = load(seg_smem, plgpu.Layout.WGMMA.reduce(1))
            weights = 0.0  # dV's: Σ cᵢ·Pᵢᵀ = (P1 − λP2)ᵀ, built one map at a time (one map's tiles live at once)
            for i in range(maps):  # Pᵢᵀ from Sᵢᵀ = Kᵢ·Qᵢᵀ and the saved log-sum-exps
                s = matmul(k_smem[i], q_tiles[i].transpose((1, 0)), shape) * (cfg.scale * LOG2E)
                # the logits masked, not P (every query sees a key, so its lse is finite and exp2 of a masked logit
                # is 0), and λ loaded where used: at d = 128 either alone decides whether this warpgroup spills
                s = masked(s, NEG_INF, q0, k0, cfg, q_seg, k_seg, transposed=True)
                p = jnp.exp2(s - per_col(load(tiles["lse"][i], col), shape))
                p = weighted(i, p, None if refs.lam is None else per_col(load(lam_smem, col), shape))

                @pl.when(idx[0] + i > 0)  # cᵢ·Pᵢᵀ to warpgroup 1 through the one tile, once it has read the last
                def _():
                    plgpu.barrier_wait(free)
                p_smem[...] = p.astype(p_smem.dtype)
                plgpu.barrier_arrive(ready)
                weights = (weights + p).astype(do_tiles[0].dtype)  # 16-bit between maps, as the wgmma reads it
            return tuple(accumulate(acc, weights, do, cfg, registers=True, stage=stages[0])
                         for acc, do in zip(accs, do_tiles, strict=True))

        def keys(accs):  # warpgroup 1
            dp = matmul(v_smem[0], do_tiles[0].transpose((1, 0)), shape,  # dPᵀ = Σ_c V_c·dO_cᵀ over V's chunks
                        [(v_smem[c], do_tiles[c].transpose((1, 0))) for c in range(1, maps)])
            new = []
            for i, acc in enumerate(accs):
                plgpu.barrier_wait(ready)
                p = load(p_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
                if not compact:
                    plgpu.barrier_arrive(free)
                ds = score_grad(0, p, dp, per_col(load(tiles["rowsum"][i], col), shape), None)  # cᵢ already in p
                new.append(accumulate(acc, ds, q_tiles[i], cfg, registers=True, stage=stages[1]))
                if fused:  # these keys' share of dQᵢ = dSᵢ·Kᵢ (dSᵢ read transposed from its tile), added into dQ
                    ds_tile = p_smem if compact else ds_smem[i]
                    ds_tile[...] = ds.astype(ds_tile.dtype)
                    plgpu.commit_smem()
                    width = dq_smem.shape[-1]
                    for c in range(chunk // width):
                        cols = pl.ds(c * width, width)
                        k_cols = k_smem[i] if width == chunk else k_smem[i].at[:, cols]
                        dq_smem[...] = matmul(ds_tile.transpose((1, 0)), k_cols, (bq, width)) * cfg.scale
                        rows = pl.ds(q_block(idx[0]) * bq, bq)
                        if cfg.interpret:
                            copy_out([(dq_smem, out.dq[i].at[bi, ki, lax.axis_index("tile"), rows, cols])])
                        else:
                            copy_out([(dq_smem, out.dq[i].at[bi, ki, rows, cols])], reduction_op="add")
                    if compact:
                        plgpu.barrier_arrive(free)
            return tuple(new)

        return lax.cond(wg == 0, values, keys, accs)

    # every step is visible to the tile's keys (causal: from the diagonal on): no step skipped, as the handoff needs
    run_pipeline(step, (group * per_head,), _q_tiles(refs, q_block, bi, ki, t, cfg, do_chunks=maps), compute, cfg, 2)

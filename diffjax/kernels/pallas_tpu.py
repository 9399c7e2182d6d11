"""Fused differential flash attention for TPU: Pallas with the Mosaic TPU lowering (docs/design.md §4).

The algorithm of `pallas_gpu` (one map or two) in a TPU structure: [B, H, T, d] layout, the key loop as the innermost
grid axis with the softmax state in VMEM, λ in SMEM (docs/kernels.md, "The TPU kernel").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.common import (
    LOG2E,
    NEG_INF,
    KernelConfig,
    and_,
    combine,
    cost_estimate,
    forward_outputs,
    kernel_name,
    kernel_refs,
    public_ops,
    score_grads,
    shape_of,
)
from diffjax.kernels.fused_blocks import FusedBlocks
from diffjax.kernels.fused_vjp import fused_attention
from diffjax.kernels.impl import Impl

_LANES, _SUBLANES = 128, 8  # Mosaic tiles the last two dims of a block by (8, 128)
_Q_FIELDS = ("block_q", "block_q_dkv", "block_q_dq")
_K_FIELDS = ("block_k", "block_k_dkv", "block_k_dq")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """TPU tile sizes (forward block_q × block_k, dK/dV *_dkv, dQ *_dq): key blocks lie on lanes, multiples of 128;
    query blocks on sublanes, multiples of 8 (docs/kernels.md, "The TPU kernel"). The defaults (128) are not tuned."""

    block_q: int = 128
    block_k: int = 128
    block_q_dkv: int = 128
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 128

    def __post_init__(self):
        for fields, unit, what in ((_Q_FIELDS, _SUBLANES, "sublanes"), (_K_FIELDS, _LANES, "lanes")):
            for f in fields:
                value = getattr(self, f)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % unit:
                    raise ValueError(f"BlockSizes.{f} must be a positive multiple of {unit} (TPU {what}), "
                                     f"got {value!r}")

    @classmethod
    def get_default(cls, head_dim: int = 128) -> BlockSizes:
        del head_dim  # one default for every head dim (the head dim is a whole block dim on TPU)
        return cls()

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this: the lcm, as blocks need not be powers of two."""
        return math.lcm(*(getattr(self, f) for f in _Q_FIELDS + _K_FIELDS))

    def clamp(self, length: int) -> BlockSizes:
        """Cap every block at max(128, next power of two ≥ `length`), a multiple of 128, so clamped blocks stay
        valid; a sequence shorter than 128 is padded up to 128 instead."""
        cap = max(_LANES, pl.next_power_of_2(length))
        return dataclasses.replace(self, **{f: min(getattr(self, f), cap) for f in _Q_FIELDS + _K_FIELDS})


_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b
_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    # HIGHEST (full fp32 passes on the MXU) only for float32 operands: Mosaic rejects an fp32 contract precision on
    # bf16 / f16 operands. DEFAULT is explicit so that a global `jax_default_matmul_precision` cannot override it.
    f32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _mask(i, j, bq, bk, q_seg_ref, k_seg_ref, cfg: KernelConfig, kv_padded: bool):
    """Boolean [bq, bk] mask for query block i and key block j, or None."""
    q_seg = q_seg_ref[...] if q_seg_ref is not None else None
    k_seg = k_seg_ref[...] if k_seg_ref is not None else None
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0) >= k_pos if cfg.causal else None
    if kv_padded:
        mask = and_(mask, k_pos < cfg.kv_len)
    if q_seg is not None:
        mask = and_(mask, q_seg == k_seg)  # [bq, 1] == [1, bk]
    return mask


def _logits(q, k, mask, c):
    s = _dot(q, k, _NT) * c
    return s if mask is None else jnp.where(mask, s, NEG_INF)


def _visible(i, j, bq, bk, causal):
    """Does query block i see any of key block j?"""
    return j * bk <= i * bq + bq - 1 if causal else True


def _kv_block(i, j, bq, bk, n_k, causal):
    """The key block fetched at step j of query block i: causal steps past the last visible block stay on it, so
    they issue no new DMA. Index math in lax.div/rem: `//` lowers via sign(), which Mosaic resolves per TPU."""
    return jnp.minimum(j, jnp.minimum(lax.div((i + 1) * bq - 1, bk), n_k - 1)) if causal else j


def _pallas_call(kernel, kind: str, dims, args, *, cfg: KernelConfig, maps: int, **kw):
    """Kernel `kind` ("forward", "dq", "dkv") on `args`, with its cost and name, over a grid whose last axis is the
    reduction; in TPU interpret mode (TPU semantics simulated on CPU) where asked."""
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    cost = cost_estimate(kind, dims, args, kw["out_shape"], causal=cfg.causal, maps=maps)
    return pl.pallas_call(kernel, compiler_params=params, interpret=pltpu.InterpretParams() if cfg.interpret else False,
                          cost_estimate=cost, name=kernel_name(maps, kind, "_tpu"), **kw)(*args)


def _specs(bq, bk, n_k, d, e, g, cfg: KernelConfig):
    """BlockSpecs on a grid (batch, head, query block, key block): [bq, d] and [bq, e] query-row tiles, the kv head's
    [bk, d] and [bk, e] tiles, [bq, 1] row statistics and (with segment ids) the blocks' query and key segment ids."""
    def rows(bi, hi, i, j):
        return bi, hi, i, 0

    def kv(bi, hi, i, j):
        return bi, lax.div(hi, g), _kv_block(i, j, bq, bk, n_k, cfg.causal), 0

    seg_specs = [pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, _kv_block(i, j, bq, bk, n_k, cfg.causal)))]
    return (pl.BlockSpec((None, None, bq, d), rows), pl.BlockSpec((None, None, bq, e), rows),
            pl.BlockSpec((None, None, bk, d), kv), pl.BlockSpec((None, None, bk, e), kv),
            pl.BlockSpec((None, None, bq, 1), rows), seg_specs if cfg.has_seg else [])


def _lam_and_segments(lam, seg, cfg: KernelConfig):
    """λ (DIFF, for SMEM) and segment ids as a [B, T, 1] query column and a [B, 1, S] key row, where there are any."""
    return ([] if lam is None else [lam.reshape(1)]) + ([seg[0][:, :, None], seg[1][:, None, :]] if cfg.has_seg
                                                         else [])


def _fwd_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool, residuals: bool, n_k: int):
    q_refs, k_refs, v_ref, lam_ref, q_seg_ref, k_seg_ref, refs = kernel_refs(refs, maps, cfg.has_seg)
    outs, scratch = refs[:-3 * maps], refs[-3 * maps:]
    states = [scratch[3 * n:3 * n + 3] for n in range(maps)]  # (acc, m, l) per map
    bq, bk = q_refs[0].shape[0], k_refs[0].shape[0]
    i, j = pl.program_id(2), pl.program_id(3)
    c = cfg.scale * LOG2E

    @pl.when(j == 0)
    def _init():
        for acc, m, l in states:  # noqa: E741
            acc[...] = jnp.zeros(acc.shape, jnp.float32)
            m[...] = jnp.full(m.shape, NEG_INF, jnp.float32)
            l[...] = jnp.zeros(l.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        mask = _mask(i, j, bq, bk, q_seg_ref, k_seg_ref, cfg, kv_padded)
        v = v_ref[...]  # one V tile, every map
        for q_ref, k_ref, (acc, m, l) in zip(q_refs, k_refs, states, strict=True):  # noqa: E741
            s = _logits(q_ref[...], k_ref[...], mask, c)
            m_prev = m[...]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
            alpha = jnp.exp2(m_prev - m_new)
            p = jnp.exp2(s - m_new)
            l[...] = alpha * l[...] + jnp.sum(p, axis=-1, keepdims=True)
            acc[...] = acc[...] * alpha + _dot(p.astype(v.dtype), v)
            m[...] = m_new

    @pl.when(j == n_k - 1)
    def _finish():
        normalised = [acc[...] / l[...] for acc, _, l in states]  # noqa: E741
        o_ref = outs[0]
        o_ref[...] = combine(normalised, None if lam_ref is None else lam_ref[0]).astype(o_ref.dtype)  # one cast
        if residuals:
            for o, o_i_ref in zip(normalised, outs[1:1 + maps], strict=True):
                o_i_ref[...] = o.astype(o_i_ref.dtype)
            for (_, m, l), lse_ref in zip(states, outs[1 + maps:], strict=True):  # noqa: E741
                lse_ref[...] = m[...] + jnp.log2(l[...])


def _forward(queries, keys, v, lam, seg, cfg: KernelConfig, residuals: bool):
    """One softmax map (queries [q], keys [k], lam None) or two (DIFF) -> (o, [O_i], [lse_i]) (as pallas_gpu's)."""
    maps = len(queries)
    b, h, t, d = queries[0].shape
    n_kv, s, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    n_k = s // bk
    q_spec, o_spec, k_spec, v_spec, row_spec, seg_specs = _specs(bq, bk, n_k, d, e, h // n_kv, cfg)
    out_shape, out_specs = forward_outputs((b, h, t, e), (b, h, t, 1), o_spec, row_spec, queries[0].dtype, cfg, maps,
                                           residuals)
    stats = [pltpu.VMEM((bq, e), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32)]
    args = (*queries, *keys, v, *_lam_and_segments(lam, seg, cfg))
    o, *res = _pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, maps=maps, kv_padded=s != cfg.kv_len, residuals=residuals, n_k=n_k),
        "forward", (b, h, t, s, d, e), args, cfg=cfg, maps=maps, grid=(b, h, t // bq, n_k), out_specs=out_specs,
        in_specs=[q_spec] * maps + [k_spec] * maps + [v_spec] + ([] if lam is None else [_SMEM]) + seg_specs,
        out_shape=out_shape, scratch_shapes=stats * maps)
    return o, res[:len(res) // 2], res[len(res) // 2:]


def _tile_grads(queries, keys, v, do, lses, rowsums, lam, mask, c):
    """Per-tile P_i (recomputed), dP = dO·Vᵀ once for every map, dS_i = c_i·P_i∘(dP − D_i) with c = (1, −λ)."""
    ps = [jnp.exp2(_logits(q, k, mask, c) - lse) for q, k, lse in zip(queries, keys, lses, strict=True)]
    return ps, score_grads(ps, _dot(do, v, _NT), rowsums, lam)


def _dq_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool, n_k: int):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    dq_refs, accs = rest[:maps], rest[maps:]
    bq, bk = q_refs[0].shape[0], k_refs[0].shape[0]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        mask = _mask(i, j, bq, bk, q_seg_ref, k_seg_ref, cfg, kv_padded)
        keys = [r[...] for r in k_refs]
        _, ds = _tile_grads([r[...] for r in q_refs], keys, v_ref[...], do_ref[...], [r[...] for r in lse_refs],
                            [r[...] for r in d_refs], None if lam_ref is None else lam_ref[0], mask,
                            cfg.scale * LOG2E)
        for acc, dsi, k in zip(accs, ds, keys, strict=True):
            acc[...] += _dot(dsi.astype(k.dtype), k)

    @pl.when(j == n_k - 1)
    def _finish():
        for acc, dq_ref in zip(accs, dq_refs, strict=True):
            dq_ref[...] = (acc[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool, n_q: int, group: int):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, rest = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    dk_refs, dv_ref, acc_ks, acc_v = rest[:maps], rest[maps], rest[maps + 1:2 * maps + 1], rest[2 * maps + 1]
    bq, bk = q_refs[0].shape[0], k_refs[0].shape[0]
    j, r = pl.program_id(2), pl.program_id(3)  # key block; (query head in group, query block) flattened
    i = lax.rem(r, n_q)
    lam = None if lam_ref is None else lam_ref[0]

    @pl.when(r == 0)
    def _init():
        for acc in (*acc_ks, acc_v):
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        mask = _mask(i, j, bq, bk, q_seg_ref, k_seg_ref, cfg, kv_padded)
        queries, do = [r[...] for r in q_refs], do_ref[...]
        ps, ds = _tile_grads(queries, [r[...] for r in k_refs], v_ref[...], do, [r[...] for r in lse_refs],
                             [r[...] for r in d_refs], lam, mask, cfg.scale * LOG2E)
        acc_v[...] += _dot(combine(ps, lam).astype(do.dtype), do, _TN)
        for acc, dsi, q in zip(acc_ks, ds, queries, strict=True):
            acc[...] += _dot(dsi.astype(q.dtype), q, _TN)

    @pl.when(r == group * n_q - 1)
    def _finish():
        for acc, dk_ref in zip(acc_ks, dk_refs, strict=True):
            dk_ref[...] = (acc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = acc_v[...].astype(dv_ref.dtype)


def _backward_kernels(queries, keys, v, lam, seg, do, lses, rowsums, cfg: KernelConfig):
    """-> ([dq_i], [dk_i], dv) for one map or two (as `_forward`)."""
    maps = len(queries)
    b, h, t, d = queries[0].shape
    n_kv, s, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    g = h // n_kv
    args = (*queries, *keys, v, do, *lses, *rowsums, *_lam_and_segments(lam, seg, cfg))
    lam_specs = [] if lam is None else [_SMEM]
    kernel_args = dict(cfg=cfg, maps=maps, kv_padded=s != cfg.kv_len)
    dims = (b, h, t, s, d, e)

    # dQ: grid (B, H, q block, k block); the k axis is the reduction.
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    n_k = s // bk
    q_spec, do_spec, k_spec, v_spec, row_spec, seg_specs = _specs(bq, bk, n_k, d, e, g, cfg)
    d_queries = _pallas_call(
        functools.partial(_dq_kernel, **kernel_args, n_k=n_k), "dq", dims, args, cfg=cfg, maps=maps,
        grid=(b, h, t // bq, n_k), out_specs=[q_spec] * maps, out_shape=[shape_of(queries[0])] * maps,
        in_specs=[*[q_spec] * maps, *[k_spec] * maps, v_spec, do_spec, *[row_spec] * (2 * maps), *lam_specs,
                  *seg_specs], scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)] * maps)

    # dK/dV: grid (B, kv head, k block, (group head, q block)); the last axis is the reduction.
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    n_q = t // bq

    def q_index(bi, ki, j, r):
        return bi, ki * g + lax.div(r, n_q), lax.rem(r, n_q), 0

    q_spec, do_spec, row_spec = (pl.BlockSpec((None, None, bq, n), q_index) for n in (d, e, 1))
    k_spec, v_spec = (pl.BlockSpec((None, None, bk, n), lambda bi, ki, j, r: (bi, ki, j, 0)) for n in (d, e))
    seg_specs = [pl.BlockSpec((None, bq, 1), lambda bi, ki, j, r: (bi, lax.rem(r, n_q), 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, ki, j, r: (bi, 0, j))] if cfg.has_seg else []
    *d_keys, dv = _pallas_call(
        functools.partial(_dkv_kernel, **kernel_args, n_q=n_q, group=g), "dkv", dims, args, cfg=cfg, maps=maps,
        grid=(b, n_kv, s // bk, g * n_q), out_specs=[*[k_spec] * maps, v_spec],
        out_shape=[shape_of(keys[0])] * maps + [shape_of(v)],
        in_specs=[*[q_spec] * maps, *[k_spec] * maps, v_spec, do_spec, *[row_spec] * (2 * maps), *lam_specs,
                  *seg_specs],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32)] * maps + [pltpu.VMEM((bk, e), jnp.float32)])
    return list(d_queries), d_keys, dv


# D_i as [B, H, T, 1] columns
_fused = fused_attention(_forward, _backward_kernels, lambda do, o: jnp.sum(do * o, axis=-1, keepdims=True))


def _default_blocks(q, causal: bool = True) -> BlockSizes:
    return BlockSizes.get_default(q.shape[-1])


diff_attention, attention = public_ops(_fused, BlockSizes, _default_blocks, heads_major=True)


def block_kernels(interpret: bool = False) -> FusedBlocks:
    """These kernels on one block of a split sequence (context parallelism), default block sizes."""
    return FusedBlocks(_forward, _backward_kernels, _default_blocks, heads_major=True, interpret=interpret)


IMPL = Impl(attention, diff_attention, ("tpu",), blocks=block_kernels)

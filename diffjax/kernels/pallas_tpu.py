"""Fused differential flash attention for TPU: Pallas with the Mosaic TPU lowering (docs/design.md §4).

Same algorithm as `pallas_gpu` (read its docstring for the math); what differs is the TPU structure:

- Layout [B, H, T, d] (the wrapper transposes), so every block's last two dims are (rows, head dim), as
  Mosaic's (8, 128) tiling wants.
- The key loop is the innermost *grid* axis ("arbitrary"), not a `fori_loop`: Pallas TPU pipelines the
  K/V DMAs across grid steps, and the online-softmax state (two max/sum pairs, two float32 accumulators)
  lives in VMEM scratch between steps. Causal skipping is `pl.when` on the step plus an index_map that
  clamps the key block to the last visible one, so skipped steps issue no new DMA.
- λ sits in SMEM; row statistics (log-sum-exps, D1, D2) are [B, H, T, 1] columns; segment ids come as a
  [B, T, 1] column for queries and a [B, 1, S] row for keys, so the mask is a broadcast compare.
- Block sizes (`BlockSizes`) follow Mosaic's (8, 128) tiling: key blocks are multiples of 128, query blocks
  of 8; padding is shared with the GPU kernel (`common.prepare`).
- Backward: a dQ kernel (grid B, H, q block, k block) and a dK/dV kernel whose reduction axis runs over
  (query head of the GQA group, query block), so the group sum happens in VMEM, deterministically.

Verified on CPU in TPU interpret mode (`pltpu.InterpretParams`) against the float32 reference, forward and
all gradients, and compiled by the TPU compiler without a TPU (libtpu's deviceless compile for v4, v5e,
v5p and v6e: tests/test_aot.py), which checks Mosaic's tile layouts and VMEM sizes; the default blocks are 128.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.kernels.common import LOG2E, NEG_INF, KernelConfig, check_shapes, cost_estimate, prepare
from diffjax.kernels.fused_blocks import FusedBlocks
from diffjax.kernels.fused_vjp import fused_diff_attention

_LANES, _SUBLANES = 128, 8  # Mosaic tiles the last two dims of a block by (8, 128)
_Q_FIELDS = ("block_q", "block_q_dkv", "block_q_dq")
_K_FIELDS = ("block_k", "block_k_dkv", "block_k_dq")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """TPU tile sizes. Forward: block_q × block_k; dK/dV kernel: *_dkv; dQ kernel: *_dq.

    Mosaic wants a block's last two dims divisible by (8, 128) unless they span the whole array. A key block
    lies on lanes — in the [1, block_k] key segment-id row (the lowering rejects other sizes) and the
    [block_q, block_k] logits tiles (narrower ones would waste lanes) — so key blocks are multiples of 128; a
    query block lies on sublanes ([block_q, d] tiles, [block_q, 1] row statistics), so query blocks are
    multiples of 8. The defaults (128, MXU-sized) are not tuned: no TPU was available.
    """

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
        """Cap every block at max(128, next power of two ≥ `length`) for short sequences. The cap is a multiple
        of 128, so clamped blocks stay valid; a sequence shorter than 128 is padded up to 128 instead."""
        cap = max(_LANES, pl.next_power_of_2(length))
        return dataclasses.replace(self, **{f: min(getattr(self, f), cap) for f in _Q_FIELDS + _K_FIELDS})


_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b
# Traced index math uses lax.div/lax.rem (operands are non-negative): `//` lowers via sign(), which the Mosaic
# lowering resolves per TPU generation.


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    # HIGHEST (full fp32 passes on the MXU) only for float32 operands: Mosaic rejects an fp32 contract
    # precision on bf16 / f16 operands, which the MXU multiplies exactly anyway (float32 accumulation). DEFAULT
    # is explicit so that a global `jax_default_matmul_precision` cannot turn it back into fp32.
    f32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _interpret_arg(interpret: bool):
    # TPU interpret mode simulates TPU semantics (VMEM/SMEM, grid order) on CPU.
    return pltpu.InterpretParams() if interpret else False


def _mask(i, j, bq, bk, q_seg, k_seg, cfg: KernelConfig, kv_padded: bool):
    """Boolean [bq, bk] mask for query block i and key block j, or None."""
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    if cfg.causal:
        mask = _and(mask, i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0) >= k_pos)
    if kv_padded:
        mask = _and(mask, k_pos < cfg.kv_len)
    if q_seg is not None:
        mask = _and(mask, q_seg == k_seg)  # [bq, 1] == [1, bk]
    return mask


def _logits(q, k, mask, c):
    s = _dot(q, k, _NT) * c
    return s if mask is None else jnp.where(mask, s, NEG_INF)


def _visible(i, j, bq, bk, causal):
    """Does query block i see any of key block j?"""
    return j * bk <= i * bq + bq - 1 if causal else True


def _last_k_block(i, bq, bk, n_k, causal):
    return jnp.minimum(lax.div((i + 1) * bq - 1, bk), n_k - 1) if causal else None


# ----------------------------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, cfg: KernelConfig, kv_padded: bool, residuals: bool, n_k: int):
    q1_ref, q2_ref, k1_ref, k2_ref, v_ref, lam_ref, *refs = refs
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if cfg.has_seg else (None, None)
    outs, (acc1_ref, m1_ref, l1_ref, acc2_ref, m2_ref, l2_ref) = refs[:-6], refs[-6:]
    bq, bk = q1_ref.shape[0], k1_ref.shape[0]
    i, j = pl.program_id(2), pl.program_id(3)
    c = cfg.scale * LOG2E

    @pl.when(j == 0)
    def _init():
        for acc, m, l in ((acc1_ref, m1_ref, l1_ref), (acc2_ref, m2_ref, l2_ref)):  # noqa: E741
            acc[...] = jnp.zeros(acc.shape, jnp.float32)
            m[...] = jnp.full(m.shape, NEG_INF, jnp.float32)
            l[...] = jnp.zeros(l.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        q_seg = q_seg_ref[...] if q_seg_ref is not None else None
        k_seg = k_seg_ref[...] if k_seg_ref is not None else None
        mask = _mask(i, j, bq, bk, q_seg, k_seg, cfg, kv_padded)
        v = v_ref[...]  # one V tile, both maps
        for q_ref, k_ref, acc, m, l in ((q1_ref, k1_ref, acc1_ref, m1_ref, l1_ref),  # noqa: E741
                                        (q2_ref, k2_ref, acc2_ref, m2_ref, l2_ref)):
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
        o1 = acc1_ref[...] / l1_ref[...]
        o2 = acc2_ref[...] / l2_ref[...]
        o_ref = outs[0]
        o_ref[...] = (o1 - lam_ref[0] * o2).astype(o_ref.dtype)  # float32 subtraction, one cast
        if residuals:
            _, o1_ref, o2_ref, lse1_ref, lse2_ref = outs
            o1_ref[...] = o1.astype(o1_ref.dtype)
            o2_ref[...] = o2.astype(o2_ref.dtype)
            lse1_ref[...] = m1_ref[...] + jnp.log2(l1_ref[...])
            lse2_ref[...] = m2_ref[...] + jnp.log2(l2_ref[...])


def _seg_inputs(seg, cfg: KernelConfig):
    if not cfg.has_seg:
        return []
    q_seg, k_seg = seg
    return [q_seg[:, :, None], k_seg[:, None, :]]  # [B, T, 1] query column, [B, 1, S] key row


def _forward(q1, q2, k1, k2, v, lam, seg, cfg: KernelConfig, residuals: bool):
    b, h, t, d = q1.shape
    n_kv, s, e = k1.shape[1], k1.shape[2], v.shape[-1]
    g = h // n_kv
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    n_k = s // bk

    def kv_block(i, j):  # clamp skipped causal steps onto the last visible block: no new DMA
        return jnp.minimum(j, _last_k_block(i, bq, bk, n_k, True)) if cfg.causal else j

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    k_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_block(i, j), 0))
    v_spec = pl.BlockSpec((None, None, bk, e), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_block(i, j), 0))
    o_spec = pl.BlockSpec((None, None, bq, e), lambda bi, hi, i, j: (bi, hi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i, j: (bi, hi, i, 0))
    in_specs = [q_spec, q_spec, k_spec, k_spec, v_spec, pl.BlockSpec(memory_space=pltpu.SMEM)]
    if cfg.has_seg:
        in_specs += [pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, kv_block(i, j)))]
    out_shape = [jax.ShapeDtypeStruct((b, h, t, e), q1.dtype)]
    out_specs = [o_spec]
    if residuals:
        out_shape += [jax.ShapeDtypeStruct((b, h, t, e), cfg.residual_dtype or q1.dtype)] * 2
        out_shape += [jax.ShapeDtypeStruct((b, h, t, 1), jnp.float32)] * 2
        out_specs += [o_spec, o_spec, row_spec, row_spec]
    stats = [pltpu.VMEM((bq, e), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32)]
    args = (q1, q2, k1, k2, v, lam.reshape(1), *_seg_inputs(seg, cfg))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, kv_padded=s != cfg.kv_len, residuals=residuals, n_k=n_k),
        grid=(b, h, t // bq, n_k),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=stats * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret_arg(cfg.interpret),
        cost_estimate=cost_estimate("forward", (b, h, t, s, d, e), args, out_shape, causal=cfg.causal),
        name="diff_flash_fwd_tpu",
    )(*args)


# ---------------------------------------------------------------------------------------------- backward


def _tile_grads(q1, q2, k1, k2, v, do, lse1, lse2, d1, d2, lam, mask, c):
    """Per-tile P1, P2 (recomputed), dP = dO·Vᵀ once for both maps, dS1, dS2."""
    p1 = jnp.exp2(_logits(q1, k1, mask, c) - lse1)
    p2 = jnp.exp2(_logits(q2, k2, mask, c) - lse2)
    dp = _dot(do, v, _NT)
    return p1, p2, p1 * (dp - d1), -lam * p2 * (dp - d2)


def _dq_kernel(*refs, cfg: KernelConfig, kv_padded: bool, n_k: int):
    (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, do_ref, lse1_ref, lse2_ref, d1_ref, d2_ref, lam_ref,
     *refs) = refs
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if cfg.has_seg else (None, None)
    dq1_ref, dq2_ref, acc1_ref, acc2_ref = refs
    bq, bk = q1_ref.shape[0], k1_ref.shape[0]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc1_ref[...] = jnp.zeros(acc1_ref.shape, jnp.float32)
        acc2_ref[...] = jnp.zeros(acc2_ref.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        q_seg = q_seg_ref[...] if q_seg_ref is not None else None
        k_seg = k_seg_ref[...] if k_seg_ref is not None else None
        mask = _mask(i, j, bq, bk, q_seg, k_seg, cfg, kv_padded)
        k1, k2 = k1_ref[...], k2_ref[...]
        _, _, ds1, ds2 = _tile_grads(q1_ref[...], q2_ref[...], k1, k2, v_ref[...], do_ref[...], lse1_ref[...],
                                     lse2_ref[...], d1_ref[...], d2_ref[...], lam_ref[0], mask,
                                     cfg.scale * LOG2E)
        acc1_ref[...] += _dot(ds1.astype(k1.dtype), k1)
        acc2_ref[...] += _dot(ds2.astype(k2.dtype), k2)

    @pl.when(j == n_k - 1)
    def _finish():
        dq1_ref[...] = (acc1_ref[...] * cfg.scale).astype(dq1_ref.dtype)
        dq2_ref[...] = (acc2_ref[...] * cfg.scale).astype(dq2_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, kv_padded: bool, n_q: int, group: int):
    (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, do_ref, lse1_ref, lse2_ref, d1_ref, d2_ref, lam_ref,
     *refs) = refs
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if cfg.has_seg else (None, None)
    dk1_ref, dk2_ref, dv_ref, acc_k1, acc_k2, acc_v = refs
    bq, bk = q1_ref.shape[0], k1_ref.shape[0]
    j, r = pl.program_id(2), pl.program_id(3)  # key block; (query head in group, query block) flattened
    i = lax.rem(r, n_q)
    lam = lam_ref[0]

    @pl.when(r == 0)
    def _init():
        for acc in (acc_k1, acc_k2, acc_v):
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(_visible(i, j, bq, bk, cfg.causal))
    def _step():
        q_seg = q_seg_ref[...] if q_seg_ref is not None else None
        k_seg = k_seg_ref[...] if k_seg_ref is not None else None
        mask = _mask(i, j, bq, bk, q_seg, k_seg, cfg, kv_padded)
        q1, q2, do = q1_ref[...], q2_ref[...], do_ref[...]
        p1, p2, ds1, ds2 = _tile_grads(q1, q2, k1_ref[...], k2_ref[...], v_ref[...], do, lse1_ref[...],
                                       lse2_ref[...], d1_ref[...], d2_ref[...], lam, mask, cfg.scale * LOG2E)
        acc_v[...] += _dot((p1 - lam * p2).astype(do.dtype), do, _TN)
        acc_k1[...] += _dot(ds1.astype(q1.dtype), q1, _TN)
        acc_k2[...] += _dot(ds2.astype(q2.dtype), q2, _TN)

    @pl.when(r == group * n_q - 1)
    def _finish():
        dk1_ref[...] = (acc_k1[...] * cfg.scale).astype(dk1_ref.dtype)
        dk2_ref[...] = (acc_k2[...] * cfg.scale).astype(dk2_ref.dtype)
        dv_ref[...] = acc_v[...].astype(dv_ref.dtype)


def _backward_kernels(q1, q2, k1, k2, v, lam, seg, do, lse1, lse2, d1, d2, cfg: KernelConfig):
    b, h, t, d = q1.shape
    n_kv, s, e = k1.shape[1], k1.shape[2], v.shape[-1]
    g = h // n_kv
    kv_padded = s != cfg.kv_len
    args = (q1, q2, k1, k2, v, do, lse1, lse2, d1, d2, lam.reshape(1), *_seg_inputs(seg, cfg))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    interpret = _interpret_arg(cfg.interpret)

    # dQ: grid (B, H, q block, k block); the k axis is the reduction.
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    n_k = s // bk

    def kv_block(i, j):
        return jnp.minimum(j, _last_k_block(i, bq, bk, n_k, True)) if cfg.causal else j

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    do_spec = pl.BlockSpec((None, None, bq, e), lambda bi, hi, i, j: (bi, hi, i, 0))
    k_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_block(i, j), 0))
    v_spec = pl.BlockSpec((None, None, bk, e), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i, j: (bi, hi, i, 0))
    seg_specs = [pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, kv_block(i, j)))] if cfg.has_seg else []
    dq_out = [jax.ShapeDtypeStruct(q1.shape, q1.dtype)] * 2
    dkv_out = [jax.ShapeDtypeStruct(k1.shape, k1.dtype)] * 2 + [jax.ShapeDtypeStruct(v.shape, v.dtype)]
    dims = (b, h, t, s, d, e)
    dq1, dq2 = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, kv_padded=kv_padded, n_k=n_k),
        grid=(b, h, t // bq, n_k),
        in_specs=[q_spec, q_spec, k_spec, k_spec, v_spec, do_spec, *[row_spec] * 4, smem, *seg_specs],
        out_specs=[q_spec, q_spec],
        out_shape=dq_out,
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)] * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost_estimate("dq", dims, args, dq_out, causal=cfg.causal),
        name="diff_flash_bwd_dq_tpu",
    )(*args)

    # dK/dV: grid (B, kv head, k block, (group head, q block)); the last axis is the reduction.
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    n_q = t // bq

    def q_index(bi, ki, j, r):
        return bi, ki * g + lax.div(r, n_q), lax.rem(r, n_q), 0

    q_spec = pl.BlockSpec((None, None, bq, d), q_index)
    do_spec = pl.BlockSpec((None, None, bq, e), q_index)
    row_spec = pl.BlockSpec((None, None, bq, 1), q_index)
    k_spec = pl.BlockSpec((None, None, bk, d), lambda bi, ki, j, r: (bi, ki, j, 0))
    v_spec = pl.BlockSpec((None, None, bk, e), lambda bi, ki, j, r: (bi, ki, j, 0))
    seg_specs = [pl.BlockSpec((None, bq, 1), lambda bi, ki, j, r: (bi, lax.rem(r, n_q), 0)),
                 pl.BlockSpec((None, 1, bk), lambda bi, ki, j, r: (bi, 0, j))] if cfg.has_seg else []
    dk1, dk2, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, kv_padded=kv_padded, n_q=n_q, group=g),
        grid=(b, n_kv, s // bk, g * n_q),
        in_specs=[q_spec, q_spec, k_spec, k_spec, v_spec, do_spec, *[row_spec] * 4, smem, *seg_specs],
        out_specs=[k_spec, k_spec, v_spec],
        out_shape=dkv_out,
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32)] * 2 + [pltpu.VMEM((bk, e), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost_estimate("dkv", dims, args, dkv_out, causal=cfg.causal),
        name="diff_flash_bwd_dkv_tpu",
    )(*args)
    return dq1, dq2, dk1, dk2, dv


# ------------------------------------------------------------------------------------------- custom_vjp


# D_i as [B, H, T, 1] columns
_fused = fused_diff_attention(_forward, _backward_kernels, lambda do, o: jnp.sum(do * o, axis=-1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "block_sizes"))
def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False,
                   block_sizes: BlockSizes | None = None):
    """Fused differential attention on TPU. Shapes as `diffjax.kernels.diff_attention` ([B, T, H, d])."""
    check_shapes(q1, q2, k1, k2, v, segment_ids)
    t, e = q1.shape[1], v.shape[-1]
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be pallas_tpu.BlockSizes (TPU tiling), got {type(block_sizes).__name__}")
    blocks = block_sizes or BlockSizes.get_default(q1.shape[-1])
    q1p, q2p, k1p, k2p, vp, seg, cfg = prepare(q1, q2, k1, k2, v, segment_ids, causal=causal, blocks=blocks,
                                               interpret=interpret)
    to_bhtd = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, T, H, d] <-> [B, H, T, d]
    out = _fused(*map(to_bhtd, (q1p, q2p, k1p, k2p, vp)), jnp.asarray(lam, jnp.float32), seg, cfg)
    return to_bhtd(out)[:, :t, :, :e]


def block_kernels(interpret: bool = False) -> FusedBlocks:
    """These kernels on one block of a split sequence (context parallelism), default block sizes."""
    return FusedBlocks(_forward, _backward_kernels, lambda q: BlockSizes.get_default(q.shape[-1]), heads_major=True,
                       interpret=interpret)

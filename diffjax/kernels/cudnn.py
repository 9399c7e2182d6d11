"""impl="cudnn": the paper's FlashAttention composition of differential attention (Appendix A) on cuDNN, in its
FlashDiffAttn_2 form: `jax.nn.dot_product_attention` needs V as wide as K, so each map makes two calls on V's halves,

    O1 = [flash(q1, k1, v[..., :d]), flash(q1, k1, v[..., d:])],  O2 likewise,  out = (O1 − λ·O2) in float32, one cast.

impl="cudnn_wide_v" is FlashDiffAttn_1: one call per map with V of width 2d, through JAX's private cuDNN entry point
(Hopper and later, cuDNN ≥ 9.10). bf16/fp16 only; segment ids become a dense mask. `implementation="xla"` runs the
composition through XLA, so it is checked on CPU. Work and measurements: docs/kernels.md, "cuDNN composition".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from diffjax.kernels import reference
from diffjax.kernels.impl import Impl


def _segment_mask(segment_ids, q, k):
    """[B, 1, T, S]: within documents (cuDNN takes causality apart), or None."""
    return None if segment_ids is None else reference.make_mask(*q.shape[:2], k.shape[1], causal=False,
                                                                segment_ids=segment_ids)


def _flash(q, k, v, mask, causal, implementation):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "implementation"))
def attention(q, k, v, *, causal=True, segment_ids=None, interpret=False, implementation="cudnn"):
    """Standard attention, one cuDNN flash call. v may be wider than q/k (split into q/k-width chunks)."""
    del interpret
    d, e = q.shape[-1], v.shape[-1]
    mask = _segment_mask(segment_ids, q, k)
    if e == d:
        return _flash(q, k, v, mask, causal, implementation)
    if e % d:
        raise ValueError(f"v head dim ({e}) must equal or be a multiple of the q/k head dim ({d})")
    outs = [_flash(q, k, v[..., i:i + d], mask, causal, implementation) for i in range(0, e, d)]
    return jnp.concatenate(outs, axis=-1)


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "implementation"))
def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False,
                   implementation="cudnn"):
    """(softmax(q1k1ᵀ/√d) − λ·softmax(q2k2ᵀ/√d)) v as four flash calls (FlashDiffAttn_2, module doc)."""
    del interpret
    d = q1.shape[-1]
    if v.shape[-1] != 2 * d:
        raise ValueError(f"v head dim must be 2·d = {2 * d}, got {v.shape[-1]}")
    mask = _segment_mask(segment_ids, q1, k1)
    halves = v[..., :d], v[..., d:]

    def one_map(q, k):
        o = jnp.concatenate([_flash(q, k, half, mask, causal, implementation) for half in halves], axis=-1)
        return o.astype(jnp.float32)

    return reference.differential(one_map(q1, k1), one_map(q2, k2), lam).astype(q1.dtype)


def _flash_wide_v(q, k, v, mask, causal):
    """One cuDNN flash call whose V may be wider than Q and K (cuDNN's "MLA" case)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    return dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
                                 mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK)


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "implementation"))
def diff_attention_wide_v(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False,
                          implementation="cudnn"):
    """(A1 − λ·A2) v as two flash calls with V of width 2d (FlashDiffAttn_1); `implementation="xla"`: each call by
    the reference math."""
    del interpret
    if v.shape[-1] != 2 * q1.shape[-1]:
        raise ValueError(f"v head dim must be 2·d = {2 * q1.shape[-1]}, got {v.shape[-1]}")
    if implementation == "cudnn":
        mask = _segment_mask(segment_ids, q1, k1)
        one_map = lambda q, k: _flash_wide_v(q, k, v, mask, causal).astype(jnp.float32)  # noqa: E731
    else:
        mask = reference.make_mask(q1.shape[0], q1.shape[1], k1.shape[1], causal=causal, segment_ids=segment_ids)
        one_map = lambda q, k: reference.masked_attention(q, k, v, mask)  # noqa: E731
    return reference.differential(one_map(q1, k1), one_map(q2, k2), lam).astype(q1.dtype)


HALF = ("bfloat16", "float16")  # cuDNN flash attention takes half precision only
IMPL = Impl(attention, diff_attention, ("gpu",), HALF, auto=lambda call: True)  # "auto": measured faster than Triton
WIDE_V = Impl(diff_attention=diff_attention_wide_v, platforms=("gpu",), dtypes=HALF)  # named only until measured

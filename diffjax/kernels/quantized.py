"""XLA attention with absmax-quantized logits (the paper's §3.7 / Fig. 8), for evaluation only (`round` has no
useful gradient): the pre-softmax logits `q kᵀ/√d` quantized to `bits` bits, then the float32 softmax.

    scale = max|x| / (2^(bits−1) − 1),   x_q = round(x / scale) · scale

The max runs over the visible (masked-in) entries only. Granularity: one scale per [B, H, T, S] tensor ("tensor"),
per batch element and head ("head") or per query row ("row"). DIFF's two maps each get their own scales, or with
`shared_scale` one scale per group of both maps (the larger absmax of the two). Bind `bits`, `granularity` and
`shared_scale` with `functools.partial` and register the result as an impl (the "quantization" protocol does).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from diffjax.kernels import reference

GRANULARITIES = ("tensor", "head", "row")
_AXES = {"tensor": (0, 1, 2, 3), "head": (2, 3), "row": (3,)}  # axes of [B, H, T, S] that share one scale


def logits(q_BTHd, k_BSKd):
    """float32 `q kᵀ/√d`: [B, H, T, S]; query head i reads kv head i // (H/K)."""
    h, d, n_kv = q_BTHd.shape[2], q_BTHd.shape[3], k_BSKd.shape[2]
    if h % n_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({n_kv})")
    k = jnp.repeat(k_BSKd.astype(jnp.float32), h // n_kv, axis=2)
    return jnp.einsum("bthd,bshd->bhts", q_BTHd.astype(jnp.float32), k) / jnp.sqrt(jnp.float32(d))


def absmax(x, mask, granularity: str):
    """max |x| over the masked-in entries of each group of `x` [B, H, T, S] sharing one scale (kept dims)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")
    mask = jnp.broadcast_to(mask, x.shape)
    return jnp.max(jnp.where(mask, jnp.abs(x.astype(jnp.float32)), 0.0), axis=_AXES[granularity], keepdims=True)


def absmax_quantize(x, mask, *, bits: int, granularity: str, amax=None):
    """Absmax fake-quantization of `x` [B, H, T, S] to `bits` bits where `mask` (broadcastable) is True; entries
    outside it are returned unchanged. `amax`: the groups' max |x| to scale by (default: `x`'s own)."""
    if bits < 2:
        raise ValueError(f"absmax quantization needs at least 2 bits (a sign and one level), got {bits}")
    x = x.astype(jnp.float32)
    scale = (absmax(x, mask, granularity) if amax is None else amax) / jnp.float32(2 ** (bits - 1) - 1)
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero (or fully masked) group: nothing to scale, x_q = x = 0
    return jnp.where(mask, jnp.round(x / scale) * scale, x)


def quantized_softmax(maps: list, mask, *, bits: int, granularity: str, shared_scale: bool = False, sinks=None):
    """The softmax of each logits map [B, H, T, S] after absmax quantization: each map by its own scales, or with
    `shared_scale` all by the largest absmax among them; per-head sink logits, where given, join each denominator
    unquantized."""
    amax = None
    if shared_scale:
        amax = functools.reduce(jnp.maximum, [absmax(x, mask, granularity) for x in maps])
    return [reference.softmax(jnp.where(mask, absmax_quantize(x, mask, bits=bits, granularity=granularity,
                                                              amax=amax), reference.NEG_INF), sinks)
            for x in maps]


def _apply(p_BHTS, v_BSKe):
    v = jnp.repeat(v_BSKe.astype(jnp.float32), p_BHTS.shape[1] // v_BSKe.shape[2], axis=2)
    return jnp.einsum("bhts,bshe->bthe", p_BHTS, v)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, interpret=False, bits: int, granularity: str,
              shared_scale: bool = False):
    del interpret, shared_scale  # one map: nothing to share a scale with
    mask = reference.make_mask(q.shape[0], q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids)
    [p] = quantized_softmax([logits(q, k)], mask, bits=bits, granularity=granularity, sinks=sinks)
    return _apply(p, v).astype(q.dtype)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False, bits: int,
                   granularity: str, shared_scale: bool = False):
    del interpret
    mask = reference.make_mask(q1.shape[0], q1.shape[1], k1.shape[1], causal=causal, segment_ids=segment_ids)
    a1, a2 = quantized_softmax([logits(q1, k1), logits(q2, k2)], mask, bits=bits, granularity=granularity,
                               shared_scale=shared_scale)
    return _apply(reference.differential(a1, a2, lam), v).astype(q1.dtype)

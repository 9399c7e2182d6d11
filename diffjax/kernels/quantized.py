"""XLA attention with absmax-quantized logits (the paper's §3.7 / Fig. 8), for evaluation only (`round` has no
useful gradient): the pre-softmax logits `q kᵀ/√d` quantized to `bits` bits, then the float32 softmax.

    scale = max|x| / (2^(bits−1) − 1),   x_q = round(x / scale) · scale

The max runs over the visible (masked-in) entries only. Granularity: one scale per [B, H, T, S] tensor ("tensor"),
per batch element and head ("head") or per query row ("row"); DIFF quantizes its two maps separately. Bind `bits` and
`granularity` with `functools.partial` and register the result as an impl (the "quantization" protocol does).
"""

from __future__ import annotations

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


def absmax_quantize(x, mask, *, bits: int, granularity: str):
    """Absmax fake-quantization of `x` [B, H, T, S] to `bits` bits where `mask` (broadcastable) is True; entries
    outside it are returned unchanged."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")
    if bits < 2:
        raise ValueError(f"absmax quantization needs at least 2 bits (a sign and one level), got {bits}")
    x = x.astype(jnp.float32)
    mask = jnp.broadcast_to(mask, x.shape)
    amax = jnp.max(jnp.where(mask, jnp.abs(x), 0.0), axis=_AXES[granularity], keepdims=True)
    scale = amax / jnp.float32(2 ** (bits - 1) - 1)
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero (or fully masked) group: nothing to scale, x_q = x = 0
    return jnp.where(mask, jnp.round(x / scale) * scale, x)


def _probs(q, k, mask, bits, granularity, sinks=None):
    """Softmax of the quantized logits (per-head sink logits, where given, join the denominator unquantized)."""
    x = absmax_quantize(logits(q, k), mask, bits=bits, granularity=granularity)
    return reference.softmax(jnp.where(mask, x, reference.NEG_INF), sinks)


def _apply(p_BHTS, v_BSKe):
    v = jnp.repeat(v_BSKe.astype(jnp.float32), p_BHTS.shape[1] // v_BSKe.shape[2], axis=2)
    return jnp.einsum("bhts,bshe->bthe", p_BHTS, v)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, interpret=False, bits: int, granularity: str):
    del interpret
    mask = reference.make_mask(q.shape[0], q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids)
    return _apply(_probs(q, k, mask, bits, granularity, sinks), v).astype(q.dtype)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False, bits: int,
                   granularity: str):
    del interpret
    mask = reference.make_mask(q1.shape[0], q1.shape[1], k1.shape[1], causal=causal, segment_ids=segment_ids)
    p = reference.differential(*(_probs(q, k, mask, bits, granularity) for q, k in ((q1, k1), (q2, k2))), lam)
    return _apply(p, v).astype(q1.dtype)

"""Pure-JAX (XLA) attention: the oracle every other implementation is tested against.

Shapes (docs/design.md §8): B batch, T query length, S key length, H query heads, K kv heads, d head dim. Matmuls
take the model's dtype and accumulate in float32; softmax and the DIFF subtraction are float32; one cast at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffjax.kernels.impl import Impl

NEG_INF = -1e30  # finite, so fully masked rows give a uniform (not NaN) softmax


def make_mask(batch: int, q_len: int, kv_len: int, *, causal: bool, segment_ids=None,
              q_offset: int = 0):
    """Boolean [B, 1, T, S] mask: True where query t (at key position `q_offset + t`) may attend to key s;
    `segment_ids` ([B, T] with T == S) keeps attention inside each packed document."""
    mask = jnp.ones((batch, 1, q_len, kv_len), dtype=bool)
    if causal:
        q_pos = q_offset + jnp.arange(q_len)[:, None]
        mask = mask & (q_pos >= jnp.arange(kv_len)[None, :])[None, None]
    if segment_ids is not None:
        if segment_ids.shape != (batch, q_len) or q_len != kv_len:
            raise ValueError(f"segment_ids must be [B, T] = {(batch, q_len)} for self-attention over "
                             f"equal lengths, got {segment_ids.shape} with T={q_len}, S={kv_len}")
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask


def attention_logits(q_BTHd, k_BSKd, mask_B1TS):
    """float32 q kᵀ/√d, NEG_INF where masked: [B, H, T, S]; query head i reads kv head i // (H/K). Heads-major
    einsums run ~3× faster on CPU than over a [B, T, K, G, d] layout, also under `jax.vmap` (sweeps)."""
    b, t, h, d = q_BTHd.shape
    s, n_kv = k_BSKd.shape[1], k_BSKd.shape[2]
    if h % n_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({n_kv})")
    q = jnp.swapaxes(q_BTHd, 1, 2)  # [B, H, T, d]
    k = jnp.swapaxes(k_BSKd.astype(q.dtype), 1, 2)  # [B, K, S, d]
    f32 = jnp.float32
    if n_kv == h:
        logits = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=f32)
    else:
        logits = jnp.einsum("bkgtd,bksd->bkgts", q.reshape(b, n_kv, h // n_kv, t, d), k,
                            preferred_element_type=f32).reshape(b, h, t, s)
    return jnp.where(mask_B1TS, logits / jnp.sqrt(jnp.float32(d)), NEG_INF)


def softmax(logits_BHTS, sinks_H=None):
    """float32 softmax over the keys of masked logits [B, H, T, S]. With `sinks_H` ([H] float32 logits) each head's
    denominator also gets exp(sinks_H[h]): a key every row sees whose value is zero, so rows sum to less than 1."""
    if sinks_H is None:
        return jax.nn.softmax(logits_BHTS, axis=-1)
    sink = jnp.broadcast_to(jnp.asarray(sinks_H, jnp.float32)[None, :, None, None], (*logits_BHTS.shape[:3], 1))
    return jax.nn.softmax(jnp.concatenate([logits_BHTS, sink], axis=-1), axis=-1)[..., :-1]


def attention_probs(q_BTHd, k_BSKd, mask_B1TS, sinks_H=None):
    """float32 softmax(q kᵀ/√d + mask): [B, H, T, S], with optional per-head sink logits (`softmax`)."""
    return softmax(attention_logits(q_BTHd, k_BSKd, mask_B1TS), sinks_H)


def apply_probs(p_BHTS, v_BSKe):
    """float32 probabilities · V: P cast to V's dtype for the matmul (as the fused kernels do), float32 sums."""
    b, h, t, s = p_BHTS.shape
    n_kv = v_BSKe.shape[2]
    v = jnp.swapaxes(v_BSKe, 1, 2)  # [B, K, S, e]
    p = p_BHTS.astype(v.dtype)
    f32 = jnp.float32
    if n_kv == h:
        out = jnp.einsum("bhts,bhse->bhte", p, v, preferred_element_type=f32)
    else:
        out = jnp.einsum("bkgts,bkse->bkgte", p.reshape(b, n_kv, h // n_kv, t, s), v,
                         preferred_element_type=f32).reshape(b, h, t, -1)
    return jnp.swapaxes(out, 1, 2)  # [B, T, H, e]


def masked_attention(q, k, v, mask, sinks=None):
    """Standard attention with an explicit mask (and optional per-head sink logits); float32 result."""
    return apply_probs(attention_probs(q, k, mask, sinks), v)


def differential(first, second, lam):
    """DIFF's first − λ·second, λ in float32, of the maps or their outputs: every DIFF implementation's subtraction."""
    return first - jnp.asarray(lam, jnp.float32) * second


def masked_diff_attention(q1, q2, k1, k2, v, lam, mask):
    """(A1 − λ A2) V with an explicit mask; float32 result (the caller casts once)."""
    return apply_probs(differential(attention_probs(q1, k1, mask), attention_probs(q2, k2, mask), lam), v)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, interpret=False):
    del interpret
    mask = make_mask(q.shape[0], q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids)
    return masked_attention(q, k, v, mask, sinks).astype(q.dtype)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False):
    del interpret
    mask = make_mask(q1.shape[0], q1.shape[1], k1.shape[1], causal=causal, segment_ids=segment_ids)
    return masked_diff_attention(q1, q2, k1, k2, v, lam, mask).astype(q1.dtype)


IMPL = Impl(attention, diff_attention, features=("sinks",), blocks=lambda interpret: None)  # a split: itself per block

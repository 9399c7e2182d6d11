"""Attention layers: the baseline `Attention`, the paper's `DiffAttention` (V1) and `DiffAttentionV2`.

The differential attention math lives here and in `diffjax.kernels` (DESIGN §2):
    [Q1; Q2] = X W_Q, [K1; K2] = X W_K, V = X W_V     (adjacent sub-heads (2i, 2i+1) form (Q1_i, Q2_i))
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init      (one λ per layer, shared by all heads)
    O = RMSNorm_head((A1 − λ A2) V) · (1 − λ_init),  then W_O
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from diffjax import kernels
from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.layers import RMSNorm, dense, rotary


def lambda_init_schedule(layer):
    """λ_init(l) = 0.8 − 0.6·exp(−0.3·(l − 1)) for the 1-based layer index l (works on arrays)."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * (jnp.asarray(layer, jnp.float32) - 1.0))


def lambda_inits(cfg: ModelConfig):
    """λ_init of every layer, [n_layers] float32 (the schedule, or the configured constant)."""
    if cfg.lambda_init is not None:
        return jnp.full((cfg.n_layers,), cfg.lambda_init, jnp.float32)
    return lambda_init_schedule(jnp.arange(1, cfg.n_layers + 1))


def lambda_value(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init):
    """The re-parameterised λ, float32."""
    return (jnp.exp(jnp.sum(lambda_q1 * lambda_k1)) - jnp.exp(jnp.sum(lambda_q2 * lambda_k2))
            + lambda_init).astype(jnp.float32)


class KVCache(nn.Module):
    """Rotated keys and values for decoding, in the 'cache' collection.

    Initialise with `model.init(..., decode=True)` on a [B, max_len] input to size the buffers. Each later
    call writes its T new entries (keys rotated at their positions) at the current index and returns the
    full buffers, the mask of what each new query may see, and the new tokens' positions.
    """

    rope_theta: float

    @nn.compact
    def __call__(self, k, v):
        b, t = k.shape[:2]
        sizing = not self.has_variable("cache", "k")
        cached_k = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        positions = jnp.broadcast_to(index.value + jnp.arange(t), (b, t))
        k = rotary(k, positions, self.rope_theta)
        if sizing:  # the init pass only creates the buffers
            return k, v, reference.make_mask(b, t, t, causal=True), positions
        cached_k.value = lax.dynamic_update_slice_in_dim(cached_k.value, k, index.value, axis=1)
        cached_v.value = lax.dynamic_update_slice_in_dim(cached_v.value, v, index.value, axis=1)
        mask = reference.make_mask(b, t, cached_k.value.shape[1], causal=True, q_offset=index.value)
        index.value = index.value + t
        return cached_k.value, cached_v.value, mask, positions


def _check_decode(segment_ids):
    if segment_ids is not None:
        raise ValueError("decode=True does not take segment_ids: a KV cache holds one sequence per row")


class Attention(nn.Module):
    """Baseline multi-head attention (n_heads heads of head_dim, GQA), optional headwise RMSNorm."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode=False):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q = dense(h * d, ("embed", "heads"), "wq", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, h, d)
        k = dense(kv * d, ("embed", "kv"), "wk", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, kv, d)
        v = dense(kv * d, ("embed", "kv"), "wv", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, kv, d)
        if decode:
            _check_decode(segment_ids)
            k, v, mask, positions = KVCache(cfg.rope_theta, name="cache")(k, v)
            out = reference.masked_attention(rotary(q, positions, cfg.rope_theta), k, v, mask).astype(dtype)
        else:
            q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
            self.sow("intermediates", "qk", (q, k))  # for the outlier / attention-map evals
            out = kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=cfg.attention_impl)
        if cfg.use_headwise_norm:
            out = RMSNorm(cfg.norm_eps, name="head_norm")(out)
        out = out.reshape(b, t, h * d)
        return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=dtype)(out)


class DiffAttention(nn.Module):
    """Multi-head differential attention, DIFF Transformer V1 (the paper).

    h = n_heads heads; Q and K are viewed as 2h (resp. 2·n_kv) sub-heads of dim d, V as n_kv heads of 2d.
    Query head i reads kv group i // (h / n_kv) for both of its halves (the official flashdiff mapping).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q = dense(2 * h * d, ("embed", "heads"), "wq", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, 2 * h, d)
        k = dense(2 * kv * d, ("embed", "kv"), "wk", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, 2 * kv, d)
        v = dense(2 * kv * d, ("embed", "kv"), "wv", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, kv, 2 * d)

        vec_init = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("norm",))
        lam = lambda_value(*(self.param(n, vec_init, (d,), jnp.float32)
                             for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")), lambda_init)
        self.sow("intermediates", "lambda", lam)

        if decode:
            _check_decode(segment_ids)
            k, v, mask, positions = KVCache(cfg.rope_theta, name="cache")(k, v)
            q = rotary(q, positions, cfg.rope_theta)
            out = reference.masked_diff_attention(q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2],
                                                  v, lam, mask).astype(dtype)
        else:
            q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
            self.sow("intermediates", "qk", (q, k))  # for the outlier / attention-map evals
            out = kernels.diff_attention(q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2], v, lam,
                                         causal=True, segment_ids=segment_ids, impl=cfg.attention_impl)
        if cfg.use_headwise_norm:
            out = RMSNorm(cfg.norm_eps, name="head_norm")(out) * (1.0 - lambda_init)
        out = out.astype(dtype).reshape(b, t, h * 2 * d)
        return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=dtype)(out)


class DiffAttentionV2(nn.Module):
    """DIFF Transformer V2: one attention over 2h query heads, then O = attn[0::2] − sigmoid(x W_λ)·attn[1::2].

    λ is per token and per head; no headwise norm and no (1 − λ_init). The pair (2i, 2i+1) shares a GQA group.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, decode=False):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q = dense(2 * h * d, ("embed", "heads"), "wq", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, 2 * h, d)
        k = dense(kv * d, ("embed", "kv"), "wk", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, kv, d)
        v = dense(kv * d, ("embed", "kv"), "wv", std=cfg.init_std, dtype=dtype)(x).reshape(b, t, kv, d)
        lam = nn.sigmoid(dense(h, ("embed", "heads"), "w_lambda", std=cfg.init_std, dtype=jnp.float32)(x))
        self.sow("intermediates", "lambda", lam)
        if decode:
            _check_decode(segment_ids)
            k, v, mask, positions = KVCache(cfg.rope_theta, name="cache")(k, v)
            attn = reference.masked_attention(rotary(q, positions, cfg.rope_theta), k, v, mask)
        else:
            q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
            self.sow("intermediates", "qk", (q, k))
            attn = kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=cfg.attention_impl)
        attn = attn.astype(jnp.float32)
        out = (attn[:, :, 0::2] - lam[..., None] * attn[:, :, 1::2]).astype(dtype).reshape(b, t, h * d)
        return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=dtype)(out)

"""The Transformer baseline: `n_heads` ordinary heads of `head_dim` (2h heads of d for the baseline of a DIFF
model with h heads: the same parameter count), GQA, optional headwise RMSNorm (Table 6 row 3)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, register, standard_attention_flops, uses_headwise_norm
from diffjax.model.attention import KVCache, attention_op, check_decode, projections
from diffjax.model.layers import RMSNorm, dense, rotary


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # the baseline has none
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, d = cfg.n_heads, cfg.head_dim
        q, k, v = projections(cfg, x, q_heads=h, k_heads=cfg.kv_heads, v_dim=d)
        if decode:
            check_decode(segment_ids)
            k, v, mask, positions = KVCache(cfg.rope_theta, name="cache")(k, v)
            out = reference.masked_attention(rotary(q, positions, cfg.rope_theta), k, v, mask).astype(dtype)
        else:
            q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
            self.sow("intermediates", "qk", (q, k))  # for the outlier / attention-map evals
            out = attention_op(cfg, "attention", q, k, v, segment_ids=segment_ids)
        self.sow("intermediates", "heads", out)
        if uses_headwise_norm(cfg):
            out = RMSNorm(cfg.norm_eps, name="head_norm")(out)
            self.sow("intermediates", "normed_heads", out)
        out = out.reshape(b, t, h * d)
        return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=dtype)(out)


def _params(cfg: ModelConfig) -> int:
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    return d * h * hd + 2 * (d * kv * hd) + h * hd * d


def _map(cfg: ModelConfig, sown: dict, mask):
    q, k = sown["qk"]
    return reference.attention_probs(q, k, mask)


ARCH = register(Arch(
    name="transformer", layer=Attention, op="attention", attention_params=_params,
    attention_flops=lambda cfg, n, causal, backward: standard_attention_flops(cfg.n_heads, cfg.head_dim, n, causal,
                                                                              backward),
    attention_map=_map, matched_heads=lambda h: 2 * h, headwise_norm=False, context_parallel=True))

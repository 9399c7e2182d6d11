"""The Transformer baseline: `n_heads` ordinary heads of `head_dim` (2h heads of d for the baseline of a DIFF
model with h heads: the same parameter count), GQA, optional headwise RMSNorm (Table 6 row 3)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, matched_heads, register, row_probs, uses_headwise_norm
from diffjax.model.attention import attention_op, output_projection, projections, rope_and_cache


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # the baseline has none
        cfg = self.cfg
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=cfg.kv_heads, v_heads=cfg.kv_heads)
        out = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode)
        return output_projection(self, cfg, x, out, norm=uses_headwise_norm(cfg))


def standard_attention(layer: nn.Module, cfg: ModelConfig, q, k, v, positions, segment_ids, decode: bool,
                       sinks=None):
    """softmax(Q Kᵀ/√d) V per head, [B, T, H, d] (`sinks`: per-head logits in the denominator): the kernel op, or
    the masked reference over the KV cache."""
    q, k, v, mask, _ = rope_and_cache(layer, cfg, q, k, v, positions, segment_ids, decode)
    if decode:
        return reference.masked_attention(q, k, v, mask, sinks).astype(jnp.dtype(cfg.dtype))
    return attention_op(cfg, "attention", q, k, v, segment_ids=segment_ids, sinks=sinks)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    return row_probs(*sown["qk"], mask, rows)


ARCH = register(Arch(
    name="transformer", layer=Attention, op="attention", attention_map=_map,
    match=lambda cfg, h, d: matched_heads(h, d, 2), context_parallel=True))

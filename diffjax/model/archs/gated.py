"""Gated attention (Qiu et al. 2025, arXiv 2505.06708): standard attention whose per-head output is multiplied by
a sigmoid gate of the layer input, σ(x W_g), before W_O (`model.gate`: headwise or elementwise; docs/design.md §2)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.model.archs import Arch, gate, matched_heads, register
from diffjax.model.archs.transformer import ARCH as TRANSFORMER
from diffjax.model.archs.transformer import standard_attention
from diffjax.model.attention import output_projection, projections
from diffjax.model.layers import dense


class GatedAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # no λ
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, d = cfg.n_heads, cfg.head_dim
        q, k, v = projections(cfg, x, q_heads=h, k_heads=cfg.kv_heads, v_heads=cfg.kv_heads)
        elementwise = gate(cfg) == "elementwise"
        logits = dense(h * d if elementwise else h, ("embed", "heads"), "w_gate", std=cfg.init_std, dtype=dtype)(x)
        g = nn.sigmoid(logits.astype(jnp.float32)).reshape(b, t, h, d if elementwise else 1)
        self.sow("intermediates", "gate", g)
        out = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode)
        return output_projection(self, cfg, x, out, gate=g)  # "heads": the SDPA output, before the gate


ARCH = register(Arch(
    name="gated", layer=GatedAttention, op="attention", attention_map=TRANSFORMER.attention_map,
    # headwise: 2h heads of d as the Transformer; elementwise: five d_model × H·d' matrices, H·d' ≈ 1.6·h·d
    match=lambda cfg, h, d: matched_heads(h, d, 1.6 if gate(cfg) == "elementwise" else 2),
    headwise_norm=None, gates=("headwise", "elementwise"), map_label="A (before the gate)"))

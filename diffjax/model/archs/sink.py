"""Attention with learned sinks (gpt-oss; Levanter's `dot_product_attention_with_sink`): one learnable logit per
head joins each softmax's denominator, so a head's rows may sum to less than 1 (docs/design.md §2)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.model.archs import Arch, matched_heads, register, row_probs
from diffjax.model.archs.transformer import standard_attention
from diffjax.model.attention import output_projection, projections


class SinkAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # no λ
        cfg = self.cfg
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=cfg.kv_heads, v_heads=cfg.kv_heads)
        sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)), (cfg.n_heads,),
                           jnp.float32)
        self.sow("intermediates", "sinks", sinks)
        out = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode, sinks=sinks)
        return output_projection(self, cfg, x, out)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """p (what multiplies V): rows sum to 1 − (the sink's share)."""
    return row_probs(*sown["qk"], mask, rows, sown["sinks"])


# Logits: the keys' q kᵀ/√d (the default `attention_logits`). The sink logit is a per-head parameter, not a key's: it
# enters the map (p's denominator), not the logits, so telemetry's entropy is over the keys alone and `outliers`
# does not count it (as `quantization` leaves it unquantized).
ARCH = register(Arch(  # FLOPs: standard (+O(N) per row)
    name="sink", layer=SinkAttention, op="attention", op_features=("sinks",),
    attention_map=_map, match=lambda cfg, h, d: matched_heads(h, d, 2), headwise_norm=None,
    map_label="A (the sink's share left out)"))

"""Attention with learned sinks (gpt-oss; Levanter's `dot_product_attention_with_sink`): one learnable logit per
head joins each softmax's denominator, so a head can put weight "nowhere" and its rows sum to less than 1.

H = n_heads heads of d, GQA as the baseline (query head i reads kv head i // (H / n_kv)); s_ij = q_i·k_j/√d over
the visible keys j:
    p_ij = exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij)),   O_i = Σ_j p_ij v_j,   out = [O_1 … O_H] W_O
`sinks` ∈ R^H, float32, initialised to 0 (a virtual key of logit 0 that every row sees). The standard attention op
takes the sinks (`op="attention"` with the kernel feature "sinks"): impls that support them (`xla`, `causal_blocks`)
run it, `auto` picks among those, and an impl without them is a config error. Telemetry's `entropy_a` /
`max_logit_a` describe the softmax over the keys alone. Matched to a DIFF model with h heads as the Transformer
baseline is: 2h heads of d (+2h sink logits per layer, against DIFF's 6d λ and head-norm parameters).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.model.archs import Arch, register, row_probs
from diffjax.model.archs.transformer import standard_attention
from diffjax.model.attention import output_projection, projections


class SinkAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # no λ
        cfg = self.cfg
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=cfg.kv_heads, v_dim=cfg.head_dim)
        sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)), (cfg.n_heads,),
                           jnp.float32)
        self.sow("intermediates", "sinks", sinks)
        out = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode, sinks=sinks)
        return output_projection(self, cfg, x, out)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """p (what multiplies V): rows sum to 1 − (the sink's share)."""
    return row_probs(*sown["qk"], mask, rows, sown["sinks"])


ARCH = register(Arch(
    name="sink", layer=SinkAttention, op="attention", op_features=("sinks",),
    attention_map=_map, match=lambda cfg, h, d: (2 * h, d), headwise_norm=None,  # FLOPs: standard (+O(N) per row)
    map_label="A (the sink's share left out)"))

"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708): standard
attention whose per-head output is multiplied by a query-dependent sigmoid gate before the output projection.

H = n_heads heads of d, GQA as the baseline (query head i reads kv head i // (H / n_kv)):
    O_i = softmax(Q_i K_iᵀ / √d) V_i                    (the standard attention op: fused kernels apply)
    Y_i = O_i ⊙ σ(x W_g)_i,   out = [Y_1 … Y_H] W_O       (the gate's logits from the layer input x)
`model.gate` = "headwise": W_g ∈ R^{d_model × H}, one scalar per head and token; "elementwise": W_g ∈ R^{d_model ×
H·d}, one per channel (the paper's best variant). The gate multiplies in float32, before W_O; no headwise norm.

Parameter matching with a DIFF model of h heads of d (`recipes.model_config`): headwise, 2h heads of d (the
Transformer baseline's heads, plus d_model·2h gate weights); elementwise, whose gate adds a fifth d_model × H·d
matrix, H·d' ≈ 1.6·h·d channels (`_match`; docs/design.md §2).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.model.archs import Arch, gate, register, row_probs
from diffjax.model.archs.transformer import standard_attention
from diffjax.model.attention import output_projection, projections
from diffjax.model.layers import dense

GATES = ("headwise", "elementwise")  # the default first


class GatedAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # no λ
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        h, d = cfg.n_heads, cfg.head_dim
        q, k, v = projections(cfg, x, q_heads=h, k_heads=cfg.kv_heads, v_dim=d)
        elementwise = gate(cfg) == "elementwise"
        logits = dense(h * d if elementwise else h, ("embed", "heads"), "w_gate", std=cfg.init_std, dtype=dtype)(x)
        g = nn.sigmoid(logits.astype(jnp.float32)).reshape(b, t, h, d if elementwise else 1)
        self.sow("intermediates", "gate", g)
        out = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode)
        return output_projection(self, cfg, x, out, gate=g)  # "heads": the SDPA output, before the gate


def _match(cfg: ModelConfig, h: int, d: int) -> tuple[int, int]:
    """(heads, head_dim) whose attention weights match DIFF's 8·d_model·h·d (no GQA).

    Headwise: 2h heads of d (4·d_model·2h·d plus the d_model·2h gate: +0.05 % of the paper models' parameters).
    Elementwise: five d_model × H·d' matrices, so H·d' should be 1.6·h·d. Keep d and take H = round(1.6·h) heads
    when that is within 2 % of DIFF's attention weights (every paper size: h = 8, 10, 12, 16, 20 → 13, 16, 19, 26,
    32 heads); otherwise (the CPU sizes, h = 2, 3, where one head is a large step) the H in [h, 2h] and even d' ≥ 8
    with H·d' closest to 1.6·h·d, fewest heads on a tie (tiny: 2 heads of 26; small: 3 heads of 102).
    """
    if gate(cfg) != "elementwise":
        return 2 * h, d
    target = 1.6 * h * d
    heads = max(1, round(1.6 * h))
    if abs(heads * d - target) <= 0.02 * target:
        return heads, d
    candidates = [(heads, dim) for heads in range(h, 2 * h + 1)
                  for dim in (2 * int(target / heads / 2), 2 * int(target / heads / 2) + 2) if dim >= 8]
    return min(candidates, key=lambda hd: (abs(hd[0] * hd[1] - target), hd[0]))


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """softmax(Q Kᵀ/√d): what multiplies V; the gate scales the result afterwards (sown as "gate")."""
    return row_probs(*sown["qk"], mask, rows)


ARCH = register(Arch(
    name="gated", layer=GatedAttention, op="attention", attention_map=_map, match=_match, headwise_norm=None,
    gates=GATES, map_label="A (before the gate)"))

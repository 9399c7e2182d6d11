"""DIFF Transformer V2 (microsoft/unilm, beyond the paper): one attention over 2h query heads, then
O = attn[0::2] − sigmoid(x W_λ)·attn[1::2], λ per token and head (docs/design.md §2)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ConfigError, ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, pair_logits, register, row_probs, standard_attention_flops, take_rows
from diffjax.model.archs.transformer import standard_attention
from diffjax.model.attention import output_projection, projections
from diffjax.model.layers import dense


class DiffAttentionV2(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # V2's λ is computed from the token
        cfg, h = self.cfg, self.cfg.n_heads
        q, k, v = projections(cfg, x, q_heads=2 * h, k_heads=cfg.kv_heads, v_heads=cfg.kv_heads)
        lam = nn.sigmoid(dense(h, ("embed", "heads"), "w_lambda", std=cfg.init_std, dtype=jnp.float32)(x))
        self.sow("intermediates", "lambda", lam)
        attn = standard_attention(self, cfg, q, k, v, positions, segment_ids, decode).astype(jnp.float32)
        return output_projection(self, cfg, x, reference.differential(attn[:, :, 0::2], attn[:, :, 1::2],
                                                                      lam[..., None]))


def _pairs(sown: dict) -> dict:
    """The (q, k) of each softmax map: A_{2i} from the even query heads, A_{2i+1} from the odd ones (a pair reads
    one kv group)."""
    q, k = sown["qk"]
    return {"a1": (q[:, :, 0::2], k), "a2": (q[:, :, 1::2], k)}


def _combine(sown: dict, maps: dict, rows=None):
    """A_{2i} − λ_t A_{2i+1} with the per-token λ [B, T, h]."""
    lam = jnp.transpose(take_rows(sown["lambda"], rows), (0, 2, 1))[..., None]  # [B, h, rows, 1]
    return reference.differential(maps["a1"], maps["a2"], lam)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    return _combine(sown, {name: row_probs(q, k, mask, rows) for name, (q, k) in _pairs(sown).items()}, rows)


def _check(cfg: ModelConfig) -> None:
    q_heads, kv = 2 * cfg.n_heads, cfg.kv_heads
    if kv > 0 and q_heads % kv == 0 and (q_heads // kv) % 2:
        raise ConfigError(f"model.n_kv_heads: diff_v2 pairs its {q_heads} query heads as (2i, 2i+1); with {kv} kv "
                          f"heads, groups of {q_heads // kv} would cross GQA groups")


ARCH = register(Arch(
    name="diff_v2", layer=DiffAttentionV2, op="attention",
    attention_flops=lambda cfg, n, causal, backward: standard_attention_flops(2 * cfg.n_heads, cfg.head_dim, n,
                                                                              causal, backward),
    attention_map=_map, attention_logits=lambda cfg, sown, mask: pair_logits(_pairs(sown), mask), combine=_combine,
    headwise_norm=None, match=None,  # DIFF's heads kept
    check=_check, context_parallel=True, map_label="A1 − λA2, λ per token"))

"""Multi-query attention (Shazeer 2019): every query head reads one shared key and value head. A new architecture
is this file in `diffjax/model/archs/` plus its import at the bottom of `diffjax/model/archs/__init__.py`."""

import flax.linen as nn

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, register, row_probs, uses_headwise_norm
from diffjax.model.attention import attention_op, output_projection, projections, rope_and_cache


class MultiQueryAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        cfg = self.cfg
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=1, v_heads=1)
        # RoPE, and when decoding the KV cache and its mask; sows the rotated (q, k) as "qk" for the attention map
        q, k, v, mask, _ = rope_and_cache(self, cfg, q, k, v, positions, segment_ids, decode)
        if decode:
            out = reference.masked_attention(q, k, v, mask)  # over the cache, float32
        else:
            out = attention_op(cfg, "attention", q, k, v, segment_ids=segment_ids)  # the kernel op: any impl, sharded
        # W_O, after a head norm where `model.headwise_norm` asks for one (Arch.headwise_norm=None: the arch has none)
        return output_projection(self, cfg, x, out, norm=uses_headwise_norm(cfg))


def attention_map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """What multiplies V, [B, H, T, S] (only the query rows `rows` [B, R] where given)."""
    return row_probs(*sown["qk"], mask, rows)


ARCH = register(Arch(
    name="mqa", layer=MultiQueryAttention, op="attention", attention_map=attention_map,
    # DIFF's h heads of d have 8·d_model·h·d attention weights; these H heads of d: d_model·d·(2H + 2)
    match=lambda cfg, h, d: (4 * h - 1, d)))

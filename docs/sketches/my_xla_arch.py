"""Attention with a learned temperature per head, softmax(τ_h · q kᵀ/√d): an architecture on the plain XLA path
(`op=None`). Its logits are not the q kᵀ/√d a kernel op computes, so the layer attends itself, builds its own mask
and sows what its map and its logits need. A new architecture is this file in `diffjax/model/archs/` plus its
import at the bottom of `diffjax/model/archs/__init__.py`."""

import flax.linen as nn
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, matched_heads, register, take_rows
from diffjax.model.attention import output_projection, projections, rope_and_cache


class TemperedAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        del lambda_init  # no λ
        cfg = self.cfg
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=cfg.kv_heads, v_heads=cfg.kv_heads)
        # mask=True: no kernel op builds the causal / document mask here (when decoding: the KV cache's mask)
        q, k, v, mask, _ = rope_and_cache(self, cfg, q, k, v, positions, segment_ids, decode, mask=True)
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("heads",))
        temperature = self.param("temperature", ones, (cfg.n_heads,), jnp.float32)  # not a kernel: no weight decay
        self.sow("intermediates", "temperature", temperature)  # what its logits need besides the sown "qk"
        out = reference.apply_probs(reference.softmax(tempered_logits(q, k, mask, temperature)), v)  # float32
        return output_projection(self, cfg, x, out.astype(jnp.dtype(cfg.dtype)))


def tempered_logits(q_BTHd, k_BSKd, mask_B1TS, temperature_H):
    """τ_h · q kᵀ/√d, [B, H, T, S] float32, NEG_INF where masked."""
    logits = reference.attention_logits(q_BTHd, k_BSKd, mask_B1TS) * temperature_H[:, None, None]
    return jnp.where(mask_B1TS, logits, reference.NEG_INF)


def attention_logits(cfg: ModelConfig, sown: dict, mask) -> dict:
    """Its softmax map's logits as the layer computes them, by map name (telemetry and `outliers` read these)."""
    return {"a": tempered_logits(*sown["qk"], mask, sown["temperature"])}


def attention_map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """What multiplies V, [B, H, T, S] (only the query rows `rows` [B, R] where given)."""
    q, k = sown["qk"]
    return reference.softmax(tempered_logits(take_rows(q, rows), k, take_rows(mask, rows, axis=2),
                                             sown["temperature"]))


ARCH = register(Arch(
    name="tempered", layer=TemperedAttention, op=None, attention_map=attention_map,
    attention_logits=attention_logits, map_label="A (tempered)", headwise_norm=None,
    # the Transformer's weights plus H scalars per layer: matched as it is
    match=lambda cfg, h, d: matched_heads(h, d, 2)))

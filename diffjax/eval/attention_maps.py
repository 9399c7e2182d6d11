"""Per-layer attention maps of a trained model, recomputed from the rotated q, k each layer sows.

Each architecture defines its effective map (`Arch.attention_map`): for DIFF (V1) `A1 − λ A2` (what multiplies V),
for the baseline `A`, for V2 `A_{2i} − λ_t A_{2i+1}` with its per-token λ. float32 throughout.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model import archs, sown_per_layer


def attention_maps(cfg: ModelConfig, params, tokens, positions=None, segment_ids=None) -> np.ndarray:
    """[L, B, H, T, T] float32 maps for `tokens` [B, T] (H = the model's output heads)."""
    b, t = tokens.shape
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids)
    attention_map = archs.get(cfg.arch).attention_map
    layers = sown_per_layer(cfg, nn.meta.unbox(params), tokens, positions, segment_ids)
    return np.asarray(jnp.stack([attention_map(cfg, layer["attn"], mask) for layer in layers]))


def answer_attention(cfg: ModelConfig, params, example: dict) -> np.ndarray:
    """[query + 1] the attention of the query that predicts the first answer token over the keys 0 .. query (the
    paper's Figure 1 view) on one `retrieval_examples` example: `answer_row` of its maps."""
    maps = attention_maps(cfg, params, example["tokens"][:1], example["positions"][:1], example["segment_ids"][:1])
    return answer_row(maps[:, 0], int(np.asarray(example["answer_start"])[0, 0]))


def answer_row(maps: np.ndarray, query: int) -> np.ndarray:
    """Row `query` of one example's maps [L, H, T, S] over the keys 0 .. query: each head's row divided by its
    total absolute weight Σ|a| — signed, so A1 − λA2 keeps its negative entries, as `attention_noise`
    normalises —, then averaged over heads and layers. Its sum over a span is that span's share."""
    rows = np.asarray(maps, np.float64)[:, :, query, : query + 1]
    return (rows / np.abs(rows).sum(-1, keepdims=True)).mean((0, 1))

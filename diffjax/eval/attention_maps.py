"""Per-layer effective attention maps (`Arch.attention_map`, float32: the arch's own, what multiplies V) from what each
layer sows."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model import archs, sown_per_layer


def attention_maps(cfg: ModelConfig, params, tokens, positions=None, segment_ids=None) -> np.ndarray:
    """[L, B, H, T, T] float32 maps for `tokens` [B, T] (H = the model's output heads)."""
    return np.asarray(_maps(cfg, nn.meta.unbox(params), tokens, positions, segment_ids))


@functools.partial(jax.jit, static_argnums=0)  # one program, not each op eagerly
def _maps(cfg: ModelConfig, params, tokens, positions, segment_ids):
    mask = reference.make_mask(*tokens.shape, tokens.shape[1], causal=True, segment_ids=segment_ids)
    layers = sown_per_layer(cfg, params, tokens, positions, segment_ids)
    return jnp.stack([archs.get(cfg.arch).attention_map(cfg, layer["attn"], mask) for layer in layers])


def answer_attention(cfg: ModelConfig, params, example: dict) -> np.ndarray:
    """[query + 1]: `answer_row` of one `retrieval_examples` example at the query predicting its first answer token."""
    maps = attention_maps(cfg, params, example["tokens"][:1], example["positions"][:1], example["segment_ids"][:1])
    return answer_row(maps[:, 0], int(np.asarray(example["answer_start"])[0, 0]))


def answer_row(maps: np.ndarray, query: int) -> np.ndarray:
    """Row `query` of one example's maps [L, H, T, S] over the keys 0 .. query, each head's row divided by Σ|a|
    (signed, as `attention_noise` normalises), averaged over heads and layers: its sum over a span is its share."""
    rows = np.asarray(maps, np.float64)[:, :, query, : query + 1]
    return (rows / np.abs(rows).sum(-1, keepdims=True)).mean((0, 1))

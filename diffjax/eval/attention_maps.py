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
from diffjax.model import DecoderLM, archs, per_layer


def attention_maps(cfg: ModelConfig, params, tokens, positions=None, segment_ids=None) -> np.ndarray:
    """[L, B, H, T, T] float32 maps for `tokens` [B, T] (H = the model's output heads)."""
    b, t = tokens.shape
    _, state = DecoderLM(cfg).apply({"params": nn.meta.unbox(params)}, tokens, positions, segment_ids,
                                    mutable=["intermediates"])
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids)
    attention_map = archs.get(cfg.arch).attention_map
    maps = []
    for layer in per_layer(state["intermediates"], cfg):
        sown = {name: value[0] for name, value in layer["attn"].items()}  # sow stores a 1-tuple
        maps.append(attention_map(cfg, sown, mask))
    return np.asarray(jnp.stack(maps))

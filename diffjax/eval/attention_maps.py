"""Per-layer attention maps of a trained model, recomputed from the rotated q, k each layer sows.

For DIFF (V1) the map is the effective `A1 − λ A2` (what multiplies V); for the baseline it is `A`; for V2
it is `A_{2i} − λ_t A_{2i+1}` with its per-token λ. float32 throughout.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model import DecoderLM


def _per_layer(intermediates, name: str, cfg: ModelConfig) -> list:
    """The sown value `name` of every layer's attention, unrolled or scanned."""
    if cfg.scan_layers:
        value = intermediates["layers"]["block"]["attn"][name][0]
        return [jax.tree.map(lambda x, i=i: x[i], value) for i in range(cfg.n_layers)]
    return [intermediates[f"layer_{i}"]["attn"][name][0] for i in range(cfg.n_layers)]


def attention_maps(cfg: ModelConfig, params, tokens, positions=None, segment_ids=None) -> np.ndarray:
    """[L, B, H, T, T] float32 maps for `tokens` [B, T] (H = the model's output heads)."""
    b, t = tokens.shape
    _, state = DecoderLM(cfg).apply({"params": nn.meta.unbox(params)}, tokens, positions, segment_ids,
                                    mutable=["intermediates"])
    inter = state["intermediates"]
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids)
    maps = []
    for i, (q, k) in enumerate(_per_layer(inter, "qk", cfg)):
        if cfg.arch == "diff":
            lam = _per_layer(inter, "lambda", cfg)[i]
            a1 = reference.attention_probs(q[:, :, 0::2], k[:, :, 0::2], mask)
            a2 = reference.attention_probs(q[:, :, 1::2], k[:, :, 1::2], mask)
            maps.append(a1 - lam * a2)
        elif cfg.arch == "diff_v2":
            lam = _per_layer(inter, "lambda", cfg)[i]  # [B, T, h]
            a = reference.attention_probs(q, k, mask)
            maps.append(a[:, 0::2] - jnp.transpose(lam, (0, 2, 1))[..., None] * a[:, 1::2])
        else:
            maps.append(reference.attention_probs(q, k, mask))
    return np.asarray(jnp.stack(maps))

"""Llama → DIFF: each Llama head becomes the first map of a DIFF head and λ starts at 0, so the converted model
computes the Llama's function exactly (the construction: docs/design.md §2, "Llama → DIFF"). A Llama here is any
plain transformer: Mistral, and Qwen2 / Qwen3 with their q/k/v biases and q/k norms, convert the same way.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax import checks
from diffjax.config import ConfigError, ModelConfig
from diffjax.model import DecoderLM, archs, lambda_inits


def diff_config(llama: ModelConfig) -> ModelConfig:
    """The DIFF model a Llama converts to: its heads, head dim, GQA groups, biases and q/k norms, no per-head norm
    (and no HF class: `hf_class` unset)."""
    if llama.arch != "transformer" or archs.uses_headwise_norm(llama):
        raise ConfigError(f"--as diff converts a Llama (a plain transformer), not model.arch={llama.arch!r}"
                          + (" with a head norm" if llama.arch == "transformer" else ""))
    cfg = dataclasses.replace(llama, arch="diff", headwise_norm=False, hf_class=None)
    checks.check_model(cfg)
    return cfg


def _pair_blocks(old: np.ndarray, fresh: np.ndarray, n: int, d: int) -> np.ndarray:
    """[..., n·d] Llama columns (a kernel's, a bias's) and [..., 2n·d] fresh DIFF ones → block 2j = Llama block j,
    2j+1 = fresh's."""
    out = fresh.reshape(*fresh.shape[:-1], 2 * n, d).copy()
    out[..., 0::2, :] = old.reshape(*old.shape[:-1], n, d)
    return out.reshape(fresh.shape)


def _zero_lambda(attn: dict, lambda_init: float) -> dict:
    """The fresh λ vectors with λ_k2 solved so that λ = 0 (float64 solve, float32 result)."""
    q1, k1, q2 = (np.asarray(attn[n], np.float64) for n in ("lambda_q1", "lambda_k1", "lambda_q2"))
    b = np.log(np.exp(q1 @ k1) + lambda_init)  # exp(b) − exp(a) = λ_init
    return {"lambda_k2": (q2 * b / (q2 @ q2)).astype(np.float32)}


def llama_to_diff(llama: ModelConfig, params: dict, seed: int = 0) -> tuple[ModelConfig, dict]:
    """(DIFF ModelConfig, unrolled float32 NumPy params) computing the same function as the Llama `params`
    (unrolled, as `diffjax.hf.load_pretrained` returns them); `seed` draws the new parameters."""
    cfg = diff_config(llama)
    h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    tokens = jnp.zeros((1, 8), jnp.int32)
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    fresh = jax.tree.map(np.asarray, nn.meta.unbox(DecoderLM(unrolled).init(jax.random.key(seed), tokens)["params"]))
    inits = np.asarray(lambda_inits(cfg), np.float64)
    out = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
    for i in range(cfg.n_layers):
        old, new = params[f"layer_{i}"], fresh[f"layer_{i}"]
        attn, new_attn = old["attn"], new["attn"]
        wo = np.zeros_like(new_attn["wo"]["kernel"]).reshape(h, 2, d, -1)
        wo[:, 0] = attn["wo"]["kernel"].reshape(h, d, -1)
        converted = {n: new_attn[n] for n in ("lambda_q1", "lambda_k1", "lambda_q2")}
        converted |= _zero_lambda(new_attn, float(inits[i]))
        converted |= {"wo": {"kernel": wo.reshape(new_attn["wo"]["kernel"].shape)}}
        for name, n in (("wq", h), ("wk", kv), ("wv", kv)):  # kernel, and bias where the model has one
            converted[name] = {leaf: _pair_blocks(w, new_attn[name][leaf], n, d) for leaf, w in attn[name].items()}
        converted |= {n: attn[n] for n in ("q_norm", "k_norm") if n in attn}  # one scale of d, shared by sub-heads
        out[f"layer_{i}"] = {**old, "attn": converted}
    return cfg, out

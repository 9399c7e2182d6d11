"""Llama → DIFF: each Llama head becomes the first map of a DIFF head; with λ = 0 at the start (or the negative
branch ramped in from 0, `model.lambda_ramp_steps`) the converted model computes the Llama's function exactly (the
construction: docs/design.md §2, "Llama → DIFF"; the starts: docs/hf.md). A Llama here is any
plain transformer: Mistral, and Qwen2 / Qwen3 with their q/k/v biases and q/k norms, convert the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffjax import checks
from diffjax.config import ConfigError, ModelConfig
from diffjax.model import archs, lambda_inits
from diffjax.model.archs.diff import LAMBDA_PARAMS, LAMBDA_RAMP


def diff_config(llama: ModelConfig) -> ModelConfig:
    """The DIFF model a Llama converts to: its heads, head dim, GQA groups, biases and q/k norms, no per-head norm
    (and no HF class: `hf_class` unset)."""
    if llama.arch != "transformer" or archs.uses_headwise_norm(llama):
        raise ConfigError(f"--as diff converts a Llama (a plain transformer), not model.arch={llama.arch!r}"
                          + (" with a head norm" if llama.arch == "transformer" else ""))
    cfg = dataclasses.replace(llama, arch="diff", headwise_norm=False, hf_class=None)
    checks.check_model(cfg)
    return cfg


# What A2 and λ start as (docs/hf.md, "Conversion starts"); every start keeps the Llama's heads as A1, V's first half
# and o_proj, and gives V a fresh second half whose o_proj rows are zero.
STARTS = ("exact", "lambda-init", "axolotl", "paired")


def _second(start: str, name: str, w: np.ndarray, n: int, d: int, shift: int, draw) -> np.ndarray:
    """The odd (A2's, or V's new) blocks [..., n, d] beside the Llama's `w` [..., n·d] of projection `name`: fresh
    (kernels drawn as the model initialises them, biases 0); axolotl's zeros for W_Q2, W_K2; or the Llama's own heads
    `shift` blocks on (each query head paired with the same head of the next KV group, or the next head under MQA)."""
    blocks = w.reshape(*w.shape[:-1], n, d)
    if name != "wv" and start == "axolotl":
        return np.zeros_like(blocks)
    if name != "wv" and start == "paired":
        return np.roll(blocks, -shift, axis=-2)
    return draw(blocks.shape) if w.ndim == 2 else np.zeros_like(blocks)


def _lambda_vectors(start: str, lambda_init: float, d: int, draw) -> dict:
    """λ's four vectors: fresh ones (normal, 0.1) with λ_k2 solved in float64 so that λ = 0 (exact) or λ = λ_init;
    axolotl's zeros (λ = λ_init; each vector's gradient is proportional to its partner, so λ stays there)."""
    if start == "axolotl":
        return {n: np.zeros(d, np.float32) for n in LAMBDA_PARAMS}
    q1, k1, q2 = (draw((d,), 0.1) for _ in range(3))
    a = q1.astype(np.float64) @ k1
    b = a if start != "exact" else np.log(np.exp(a) + lambda_init)  # exp(b) − exp(a) = λ_init − λ
    return {"lambda_q1": q1, "lambda_k1": k1, "lambda_q2": q2, "lambda_k2": (q2 * b / (q2 @ q2)).astype(np.float32)}


def llama_to_diff(llama: ModelConfig, params: dict, seed: int = 0, start: str = "exact") -> tuple[ModelConfig, dict]:
    """(DIFF ModelConfig, unrolled float32 NumPy params) of the Llama `params` (unrolled, as
    `diffjax.hf.load_pretrained` returns them), A2 and λ as `start` makes them; `seed` draws the new parameters.
    `params` is consumed: each Llama layer is dropped as its DIFF layer is made."""
    if start not in STARTS:
        raise ConfigError(f"--start {start!r}: one of {', '.join(STARTS)}")
    cfg = diff_config(llama)
    h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    inits = np.asarray(lambda_inits(cfg), np.float64)
    out = {k: params.pop(k) for k in ("embed", "final_norm", "lm_head") if k in params}
    for i in range(cfg.n_layers):
        old = params.pop(f"layer_{i}")
        attn, rng = old["attn"], np.random.default_rng([seed, i])
        draw = lambda shape, std=cfg.init_std, rng=rng: rng.normal(0.0, std, shape).astype(np.float32)  # noqa: E731
        wo = np.zeros((h, 2, d, cfg.d_model), np.float32)
        wo[:, 0] = attn["wo"]["kernel"].reshape(h, d, -1)
        converted = _lambda_vectors(start, float(inits[i]), d, draw) | {"wo": {"kernel": wo.reshape(2 * h * d, -1)}}
        for name, n, shift in (("wq", h, h // kv if kv > 1 else 1), ("wk", kv, 1), ("wv", kv, 0)):
            converted[name] = {}
            for leaf, w in attn[name].items():  # kernel, and bias where the model has one: block 2j = the Llama's j
                pair = np.stack([w.reshape(*w.shape[:-1], n, d), _second(start, name, w, n, d, shift, draw)], -2)
                converted[name][leaf] = pair.reshape(*w.shape[:-1], 2 * n * d)
        converted |= {n: attn[n] for n in ("q_norm", "k_norm") if n in attn}  # one scale of d, shared by sub-heads
        if cfg.lambda_ramp_steps:
            converted[LAMBDA_RAMP] = np.zeros((), np.float32)  # ramp(0) = 0: A2 enters from step 1 on
        out[f"layer_{i}"] = {**old, "attn": converted}
    return cfg, out

"""DIFF Transformer V1 (the paper): O = RMSNorm_head((A1 − λ A2) V) · (1 − λ_init), one λ per layer
(docs/design.md §2, "Differential attention")."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, pair_logits, register, row_probs, uses_headwise_norm
from diffjax.model.attention import attention_op, output_projection, projections, rope_and_cache

# λ's re-parameterisation vectors, by the names the optimizer (no weight decay, λ warm-up) and the HF mapping read.
LAMBDA_PARAMS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
# With model.lambda_ramp_steps: each layer's λ multiplier min(1, step / N), kept with the params so a checkpoint
# (evaluated, generated from, resumed) computes its own step's function; set by the train step, never learned.
LAMBDA_RAMP = "lambda_ramp"


def lambda_value(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init):
    """The re-parameterised λ, float32."""
    return (jnp.exp(jnp.sum(lambda_q1 * lambda_k1)) - jnp.exp(jnp.sum(lambda_q2 * lambda_k2))
            + lambda_init).astype(jnp.float32)


class DiffAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        cfg = self.cfg
        halves, mask, _ = differential_inputs(self, cfg, x, lambda_init, positions, segment_ids, decode)
        if decode:
            out = reference.masked_diff_attention(*halves, mask).astype(jnp.dtype(cfg.dtype))
        else:
            out = attention_op(cfg, "diff_attention", *halves, segment_ids=segment_ids)
        return output_projection(self, cfg, x, out, norm=uses_headwise_norm(cfg), norm_scale=1.0 - lambda_init)


def differential_inputs(layer: nn.Module, cfg: ModelConfig, x, lambda_init, positions, segment_ids, decode: bool):
    """((q1, q2, k1, k2, v, λ), mask, positions) of a DIFF layer, rotated (and cached when decoding); λ's four
    vectors are created in the layer's scope and λ sown as "lambda"."""
    q, k, v = projections(cfg, x, q_heads=2 * cfg.n_heads, k_heads=2 * cfg.kv_heads,
                              v_heads=cfg.kv_heads, v_dim=2 * cfg.head_dim)
    vec_init = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("norm",))
    lam = lambda_value(*(layer.param(n, vec_init, (cfg.head_dim,), jnp.float32) for n in LAMBDA_PARAMS), lambda_init)
    if cfg.lambda_ramp_steps:  # ramp(t)·λ: the ramp's value at the params' step, written by the train step
        lam = lam * jax.lax.stop_gradient(layer.param(LAMBDA_RAMP, nn.initializers.zeros, (), jnp.float32))
    layer.sow("intermediates", "lambda", lam)
    q, k, v, mask, positions = rope_and_cache(layer, cfg, q, k, v, positions, segment_ids, decode)
    return (q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2], v, lam), mask, positions


def layer_lambda(attn_params: dict, lambda_init):  # λ of a trained layer
    return lambda_value(*(attn_params[n] for n in LAMBDA_PARAMS), lambda_init)


def _flops(cfg: ModelConfig, seq_len: int, causal: bool, backward: bool) -> float:
    """Fused DIFF attention in units of h·N²·d (docs/design.md §FLOPs): forward 12, backward 20."""
    units = 12.0 + (20.0 if backward else 0.0)
    return units * cfg.n_heads * seq_len**2 * cfg.head_dim * (0.5 if causal else 1.0)


def pairs(sown: dict) -> dict:
    """The (q, k) of each softmax map: A1 from the even sub-heads of q and k, A2 from the odd ones."""
    q, k = sown["qk"]
    return {"a1": (q[:, :, 0::2], k[:, :, 0::2]), "a2": (q[:, :, 1::2], k[:, :, 1::2])}


def _combine(sown: dict, maps: dict, rows=None):
    """The effective map A1 − λ A2 (what multiplies V); rows sum to 1 − λ."""
    del rows  # λ is per head
    return reference.differential(maps["a1"], maps["a2"], sown["lambda"])


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    return _combine(sown, {name: row_probs(q, k, mask, rows) for name, (q, k) in pairs(sown).items()})


ARCH = register(Arch(
    name="diff", layer=DiffAttention, op="diff_attention", attention_flops=_flops, attention_map=_map,
    attention_logits=lambda cfg, sown, mask: pair_logits(pairs(sown), mask), headwise_norm=True,
    context_parallel=True, layer_lambda=layer_lambda, map_label="A1 − λA2", combine=_combine))

"""Building blocks: RMSNorm, SwiGLU, rotary embeddings, and a logically-partitioned dense layer."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffjax.config import ModelConfig


def dense(features: int, axes: tuple[str, str], name: str, *, std: float, dtype, bias: bool = False) -> nn.Dense:
    """A projection (bias-free unless `bias`, a zero-initialised one) whose parameters carry logical axis names
    (docs/design.md §3)."""
    init = nn.with_logical_partitioning(nn.initializers.normal(std), axes)
    bias_init = nn.with_logical_partitioning(nn.initializers.zeros, axes[1:])
    return nn.Dense(features, use_bias=bias, kernel_init=init, bias_init=bias_init, dtype=dtype,
                    param_dtype=jnp.float32, name=name)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back to the input dtype."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        weight = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                            (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * weight).astype(x.dtype)


class SwiGLU(nn.Module):
    """(swish(x W_G) * x W_1) W_2."""

    hidden: int
    std: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        # Tokens as one axis: XLA:CPU then lays out the backward's weight-gradient matmuls without a transposing copy
        # of [B·T, F] per layer (1.7× faster, bitwise the same gradients; docs/benchmarks.md).
        x2 = x.reshape(-1, x.shape[-1])
        gate = dense(self.hidden, ("embed", "mlp"), "w_gate", std=self.std, dtype=self.dtype)(x2)
        up = dense(self.hidden, ("embed", "mlp"), "w_up", std=self.std, dtype=self.dtype)(x2)
        out = dense(x.shape[-1], ("mlp", "embed"), "w_down", std=self.std, dtype=self.dtype)(nn.silu(gate) * up)
        return out.reshape(x.shape)


def rope_frequencies(cfg: ModelConfig, d: int):
    """The d/2 inverse frequencies of RoPE over d channels, scaled as `cfg.rope_scaling` says, in transformers'
    order of float32 operations (`modeling_rope_utils`; none of its types scales cos / sin by an attention factor):
    equal to ~1e-6 relative (torch and XLA round a power or a division differently; tests/test_hf.py)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":  # `_compute_llama3_parameters`, in its order of float32 operations
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        context = cfg.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        long = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)  # long wavelengths: / factor
        smooth = (context / wavelen - low) / (high - low)  # 0 → 1 across the band between the two wavelengths
        smoothed = (1 - smooth) * long / factor + smooth * long
        in_band = ~(wavelen < context / high) & ~(wavelen > context / low)
        return jnp.where(in_band, smoothed, long)
    return inv_freq


def rotary(x_BTNd, positions_BT, cfg: ModelConfig):
    """Rotary position embedding (rotate-half form, float32 math) at `rope_frequencies`, on every head of dim d."""
    d = x_BTNd.shape[-1]
    inv_freq = rope_frequencies(cfg, d)
    angles = positions_BT.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_BTNd.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNd.dtype)

"""Training FLOPs, counted algorithmically, for throughput and MFU (docs/design.md, "FLOPs"): 2 per multiply-add,
3× the forward for weights (forward + two backward matmuls), attention as each architecture counts it."""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax

from diffjax.config import ModelConfig
from diffjax.model import abstract_params, archs


def attention_flops(cfg: ModelConfig, seq_len: int, *, causal: bool = True, backward: bool = True) -> float:
    """FLOPs of one attention call of `cfg`'s arch on one sequence of `seq_len` tokens."""
    return archs.get(cfg.arch).attention_flops(cfg, seq_len, causal, backward)


@functools.lru_cache(maxsize=256)
def attention_params(cfg: ModelConfig) -> int:
    """Matmul weights of one attention layer: the Dense kernels (`kernel` leaves) of a one-layer model's `attn`
    parameters; its other parameters (head norm scales, λ vectors, sink logits) are elementwise."""
    one_layer = dataclasses.replace(cfg, n_layers=1, scan_layers=False, remat="none", attention_impl="xla")
    attn = nn.meta.unbox(abstract_params(one_layer))["layer_0"]["attn"]
    return sum(math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(attn)[0]
               if path[-1].key == "kernel")


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: all projections and the output layer
    (the input embedding is a lookup; norms and λ vectors are elementwise)."""
    attn = attention_params(cfg)
    return cfg.n_layers * (attn + 3 * cfg.d_model * cfg.resolved_ffn_dim) + cfg.vocab_size * cfg.d_model


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token at sequence length `seq_len` (causal)."""
    return 6.0 * matmul_params(cfg) + cfg.n_layers * attention_flops(cfg, seq_len) / seq_len

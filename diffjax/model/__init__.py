"""The DIFF Transformer / Transformer decoder LM, its parameter count and KV-cache decoding."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffjax.config import ModelConfig
from diffjax.model import archs
from diffjax.model.attention import lambda_init_schedule, lambda_inits
from diffjax.model.transformer import DecoderLM, output_logits, per_layer, sown_per_layer

__all__ = ["DecoderLM", "archs", "lambda_init_schedule", "lambda_inits", "output_logits", "param_count",
           "abstract_params", "init_cache", "decode_step", "layer_lambdas", "per_layer", "sown_per_layer"]


def abstract_params(cfg: ModelConfig):
    """Parameter shapes (boxed with their logical axis names) without allocating anything."""
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(lambda t: DecoderLM(cfg).init(jax.random.key(0), t), tokens)["params"]


def param_count(cfg: ModelConfig) -> dict:
    """{'params': all, 'params_embedding': embedding (+ output) matrices, 'params_paper': counting one
    embedding matrix, as the paper's size names do}."""
    leaves = jax.tree_util.tree_leaves(nn.meta.unbox(abstract_params(cfg)))
    total = sum(math.prod(x.shape) for x in leaves)
    one_matrix = cfg.vocab_size * cfg.d_model
    embedding = one_matrix * (1 if cfg.tie_embeddings else 2)
    return {"params": total, "params_embedding": embedding,
            "params_paper": total - (0 if cfg.tie_embeddings else one_matrix)}


def layer_lambdas(params, cfg: ModelConfig, lambda_init=None):
    """The current λ of every layer, [n_layers] float32, for archs with one λ per layer (DIFF V1); else None.
    `lambda_init` [n_layers] overrides the config's λ_init."""
    layer_lambda = archs.get(cfg.arch).layer_lambda
    if layer_lambda is None:
        return None
    inits = lambda_inits(cfg) if lambda_init is None else lambda_init
    layers = per_layer(nn.meta.unbox(params), cfg)
    return jnp.stack([layer_lambda(layer["attn"], inits[i]) for i, layer in enumerate(layers)])


def init_cache(cfg: ModelConfig, batch: int, max_len: int, start=None):
    """An empty KV cache for `batch` sequences of up to `max_len` tokens. `start` [batch]: the cache slot of each
    row's first real token, for rows left-padded to a common length (`attention.KVCache`); default 0."""
    tokens = jnp.zeros((batch, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda t: DecoderLM(cfg).init(jax.random.key(0), t, decode=True), tokens)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
    if start is None:
        return cache
    start = jnp.asarray(start, jnp.int32)  # every layer's [batch] leaf ([n_layers, batch] when scanned), each its own
    return jax.tree_util.tree_map_with_path(lambda path, x: x + start if path[-1].key == "start" else x, cache)


def decode_step(cfg: ModelConfig, params, cache, tokens, *, last_only: bool = False):
    """Append `tokens` [B, T] to the cache: (logits [B, T, V], cache); with `last_only` the last token's, [B, 1, V].
    Tokens past the cache's `max_len`: a ValueError when the fill is known (eager), else NaN logits — never the
    silently wrong logits of a clamped write."""
    leaves = {path[-1].key: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]}
    scanned = leaves["index"].ndim  # nn.scan stacks the layers' caches on a leading axis
    filled, max_len = (leaves["index"][0] if scanned else leaves["index"]), leaves["k"].shape[1 + scanned]
    fits = filled + tokens.shape[1] <= max_len
    try:
        if not bool(fits):
            raise ValueError(f"decode_step: the KV cache holds {max_len} positions, {int(filled)} are filled and "
                             f"{tokens.shape[1]} more do not fit; size it with init_cache(..., max_len=...)")
    except jax.errors.ConcretizationTypeError:  # traced: the NaN below marks an overflow
        pass
    out, updates = DecoderLM(cfg).apply({"params": params, "cache": cache}, tokens, decode=True,
                                        hidden_only=last_only, mutable=["cache"])
    logits = output_logits(nn.meta.unbox(params), out[:, -1:], cfg) if last_only else out
    return jnp.where(fits, logits, jnp.nan), updates["cache"]

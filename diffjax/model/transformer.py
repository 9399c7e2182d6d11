"""Decoder-only LM: pre-RMSNorm blocks `Y = X + Attn(norm(X))`, `X' = Y + SwiGLU(norm(Y))`, LLaMA-style."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffjax import sharding
from diffjax.config import ModelConfig
from diffjax.model import archs, context_parallel
from diffjax.model.attention import KEPT, lambda_inits
from diffjax.model.layers import RMSNorm, SwiGLU, dense

ACTIVATION = ("activation_batch", "activation_length", "activation_embed")  # logical axes of [B, T, D]


class Block(nn.Module):
    cfg: ModelConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids):
        cfg = self.cfg
        x = sharding.constrain(x, ACTIVATION)  # block boundary: batch-sharded activations, whatever GSPMD infers
        y = RMSNorm(cfg.norm_eps, name="attn_norm")(x)
        y = archs.get(cfg.arch).layer(cfg, name="attn")(y, lambda_init, positions, segment_ids, self.decode)
        x = x + y
        y = SwiGLU(cfg.resolved_ffn_dim, cfg.init_std, jnp.dtype(cfg.dtype), name="mlp")(
            RMSNorm(cfg.norm_eps, name="mlp_norm")(x))
        x = sharding.constrain(x + y, ACTIVATION)
        self.sow("intermediates", "hidden", x)
        return x


def _block_class(cfg: ModelConfig):
    """Block, rematerialised by `cfg.remat`: "full" saves only its input; "dots" also its matmuls without batch dims
    (not the attention maps); "attention" the attention op's output and residuals (`attention.KEPT`)."""
    policies = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                "attention": jax.checkpoint_policies.save_only_these_names(KEPT)}
    return nn.remat(Block, policy=policies[cfg.remat]) if cfg.remat in policies else Block


class _ScanBody(nn.Module):
    """Adapts Block to nn.scan's (carry, xs) -> (carry, ys) signature."""

    cfg: ModelConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids):
        return _block_class(self.cfg)(self.cfg, self.decode, name="block")(x, lambda_init, positions, segment_ids), None


class DecoderLM(nn.Module):
    """tokens [B, T] int -> logits [B, T, vocab] float32. `segment_ids` keep attention inside documents; decode=True
    appends to the KV cache (`diffjax.model.decode_step`); `lambda_init` [n_layers] overrides the config's. Under
    context parallelism inputs are permuted into the load-balanced layout, the output back unless `keep_layout`."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, decode=False, lambda_init=None, hidden_only=False,
                 keep_layout=False):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        layout = (lambda x: x) if decode else context_parallel.to_layout  # a KV cache holds the natural order
        tokens, positions = layout(tokens), layout(positions)
        segment_ids = None if segment_ids is None else layout(segment_ids)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32, name="embed",
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                                     ("vocab", "embed")))
        x = embed(tokens)
        lam_init = lambda_inits(cfg) if lambda_init is None else lambda_init
        if cfg.scan_layers:
            scanned = nn.scan(_ScanBody, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                              split_rngs={"params": True}, in_axes=(0, nn.broadcast, nn.broadcast),
                              length=cfg.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = scanned(cfg, decode, name=SCANNED)(x, lam_init, positions, segment_ids)
        else:
            block_cls = _block_class(cfg)
            for i in range(cfg.n_layers):
                x = block_cls(cfg, decode, name=f"layer_{i}")(x, lam_init[i], positions, segment_ids)
        x = RMSNorm(cfg.norm_eps, name="final_norm")(x)
        unlayout = (lambda x: x) if decode or keep_layout else context_parallel.from_layout
        if hidden_only:  # the final hidden states [B, T, D]; `output_logits` applies the head (chunked losses)
            return unlayout(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(cfg.vocab_size, ("embed", "vocab"), "lm_head", std=cfg.init_std, dtype=dtype)(x)
        return unlayout(logits.astype(jnp.float32))


def output_logits(params, hidden, cfg: ModelConfig):
    """float32 logits of `hidden` [..., D] (from `hidden_only=True`) with the model's output head, computed as
    DecoderLM computes them (inputs and weight in the compute dtype)."""
    dtype = jnp.dtype(cfg.dtype)
    weight = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]  # [D, V]
    return jnp.dot(hidden.astype(dtype), weight.astype(dtype)).astype(jnp.float32)


SCANNED = "layers"  # the scanned stack's name; its block is `SCANNED/block`, stacked on a leading layer axis


def per_layer(tree, cfg: ModelConfig) -> list:
    """Every layer's subtree (params, or sown intermediates) of a DecoderLM tree: `layer_{i}`, or scanned
    `layers/block` stacked on a leading [n_layers] axis."""
    if cfg.scan_layers:
        stacked = tree[SCANNED]["block"]
        return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(cfg.n_layers)]
    return [tree[f"layer_{i}"] for i in range(cfg.n_layers)]


def sown_per_layer(cfg: ModelConfig, params, tokens, positions=None, segment_ids=None, **kwargs) -> list[dict]:
    """Every layer's sown values of one forward pass ({"attn": {"qk": (q, k), ...}, "hidden": ...});
    `kwargs` go to `DecoderLM.apply`."""
    _, state = DecoderLM(cfg).apply({"params": params}, tokens, positions, segment_ids, mutable=["intermediates"],
                                    **kwargs)
    return [jax.tree.map(lambda x: x[0], layer, is_leaf=lambda x: isinstance(x, tuple))  # sow stores 1-tuples
            for layer in per_layer(state["intermediates"], cfg)]

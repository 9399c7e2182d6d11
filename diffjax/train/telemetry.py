"""Stability telemetry: what the attention and the gradients do while a model trains (docs/design.md, "Telemetry").

Two parts, both per layer:

- `grad_norms(grads, cfg)` inside every train step (a few reductions over gradients the step already has):
  the global norm of the embedding, of each layer's attention (with its pre-norm) and MLP (with its pre-norm),
  and of the output head (final norm and, untied, lm_head).
- `Telemetry(cfg, mesh, stats_fn).records(params)` every `train.telemetry_every` steps, on a fixed probe — the first
  `train.telemetry_rows` rows of the first validation batch, so every point of a curve sees the same text: for each
  softmax map an arch is made of (DIFF: A1, A2; the baseline: A) its mean row entropy (nats) and max |logit|; for
  archs with more than one, the entropy of the net map A1 − λ A2 as a distribution over keys (|a| / Σ|a| per row: it
  has negative entries); the RMS of the attention output per head before and after the head norm (where there is
  one). The maps are materialised per layer: rows × heads × T² float32 each.

Records go to metrics.jsonl under split "telemetry" (lists over layers), TensorBoard, and `telemetry.png`
(`diffjax.train.telemetry_plot`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax import distributed, sharding
from diffjax.config import Config
from diffjax.data.pipeline import validation_iterator
from diffjax.kernels import reference
from diffjax.model import archs, context_parallel, per_layer, sown_per_layer


def _norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def grad_norms(grads, cfg: Config) -> dict:
    """{"grad_norm_embed", "grad_norm_attn" [L], "grad_norm_mlp" [L], "grad_norm_head"} of a gradient tree."""
    grads = nn.meta.unbox(grads)
    layers = per_layer(grads, cfg.model)
    head = {k: v for k, v in grads.items() if k in ("final_norm", "lm_head")}
    return {"grad_norm_embed": _norm(grads["embed"]),
            "grad_norm_attn": jnp.stack([_norm((layer["attn"], layer["attn_norm"])) for layer in layers]),
            "grad_norm_mlp": jnp.stack([_norm((layer["mlp"], layer["mlp_norm"])) for layer in layers]),
            "grad_norm_head": _norm(head)}


def _entropy(p, mask):
    """Mean over the rows with at least one key of -Σ p log p [nats]."""
    row = -jnp.sum(jnp.where(mask & (p > 0), p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    valid = jnp.broadcast_to(jnp.any(mask, -1), row.shape)
    return jnp.sum(jnp.where(valid, row, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _rms(x):
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


def attention_stats(params, batch, *, cfg: Config, lambda_init=None) -> dict:
    """The per-layer attention statistics of one forward pass over `batch` (lists over layers as [L] arrays)."""
    model = cfg.model
    layers = sown_per_layer(model, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                            lambda_init=lambda_init)
    b, t = batch["tokens"].shape
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=batch["segment_ids"])
    mask = context_parallel.to_layout(context_parallel.to_layout(mask, 2), 3)  # the sown q, k are in the layout
    arch = archs.get(model.arch)
    per = []
    for layer in layers:
        sown = layer["attn"]
        components = arch.attention_components(model, sown)
        stats = {}
        for name, (q, k) in components.items():
            logits = reference.attention_logits(q, k, mask)
            stats[f"entropy_{name}"] = _entropy(jax.nn.softmax(logits, axis=-1), mask)
            stats[f"max_logit_{name}"] = jnp.max(jnp.where(mask, jnp.abs(logits), 0.0))
        if len(components) > 1:
            net = jnp.abs(arch.attention_map(model, sown, mask))
            stats["entropy_net"] = _entropy(net / jnp.maximum(jnp.sum(net, -1, keepdims=True), 1e-30), mask)
        for key, name in (("heads", "head_rms"), ("normed_heads", "head_rms_normed")):  # where the arch sows them
            if key in sown:
                stats[name] = _rms(sown[key])
        per.append(stats)
    return {key: jnp.stack([stats[key] for stats in per]) for key in per[0]}


class Telemetry:
    """`Telemetry(cfg, mesh, stats_fn).records(params)` -> one record per member, with `stats_fn(params, probe)` the
    members' `attention_stats` with a leading member axis (`train.members.Stack.stats_fn`)."""

    name = "telemetry"  # the metrics.jsonl split its records are written under

    def __init__(self, cfg: Config, mesh, stats_fn):
        data = validation_iterator(cfg.data)  # every process reads the same probe: it is replicated
        try:
            rows = {k: v[: cfg.train.telemetry_rows] for k, v in data.next().items()}
        finally:
            data.close()
        self.probe = sharding.put_batch(rows, mesh, sharding.replicated(mesh))
        self.stats_fn = stats_fn

    def records(self, params) -> list[dict]:
        stats = distributed.fetch(self.stats_fn(params, self.probe))
        n = len(next(iter(stats.values())))
        return [_plain({k: v[i] for k, v in stats.items()}) for i in range(n)]


def _plain(stats: dict) -> dict:
    return {k: np.asarray(v, np.float64).tolist() for k, v in stats.items()}


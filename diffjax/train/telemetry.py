"""Stability telemetry (docs/design.md §3, "Telemetry"): per-layer gradient norms inside every train step
(`grad_norms`), and attention statistics on a fixed probe every `train.telemetry_every` steps (`Telemetry`)."""

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
    return {"grad_norm_embed": _norm(grads["embed"]),
            "grad_norm_attn": jnp.stack([_norm((layer["attn"], layer["attn_norm"])) for layer in layers]),
            "grad_norm_mlp": jnp.stack([_norm((layer["mlp"], layer["mlp_norm"])) for layer in layers]),
            "grad_norm_head": _norm({k: v for k, v in grads.items() if k in ("final_norm", "lm_head")})}


def _entropy(p, mask):
    """Mean over the rows with at least one key of -Σ p log p [nats]."""
    row = -jnp.sum(jnp.where(mask & (p > 0), p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    valid = jnp.broadcast_to(jnp.any(mask, -1), row.shape)
    return jnp.sum(jnp.where(valid, row, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


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
        maps = arch.attention_logits(model, sown, mask)  # the arch's own logits, mixed or biased as it computes
        stats = {}
        for name, logits in maps.items():
            stats[f"entropy_{name}"] = _entropy(jax.nn.softmax(logits, axis=-1), mask)
            stats[f"max_logit_{name}"] = jnp.max(jnp.where(mask, jnp.abs(logits), 0.0))
        if len(maps) > 1:
            net = jnp.abs(arch.attention_map(model, sown, mask))
            stats["entropy_net"] = _entropy(net / jnp.maximum(jnp.sum(net, -1, keepdims=True), 1e-30), mask)
        for key, name in (("heads", "head_rms"), ("normed_heads", "head_rms_normed")):  # where the arch sows them
            if key in sown:
                stats[name] = jnp.sqrt(jnp.mean(jnp.square(sown[key].astype(jnp.float32))))
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
        return [{k: np.asarray(v[i], np.float64).tolist() for k, v in stats.items()} for i in range(n)]

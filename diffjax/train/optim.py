"""Optax AdamW with the paper's schedule (linear warmup, then linear decay to the final lr), global-norm
clipping and a weight-decay mask (docs/design.md, "Training").

AdamW's hyper-parameters live in the optimizer state (`optax.inject_hyperparams`, float32), so the step reads the
learning rate it applied from the state rather than recomputing the schedule, and a sweep can hold per-member
values there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diffjax.config import OptimConfig

# Parameters named like this are matrices of the embedding family (input table, untied output head).
EMBEDDING_PARAMS = ("embedding", "lm_head")


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """0 → lr over warmup_steps, then lr → final_lr, reached by the last update (step total_steps − 1)."""
    warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    decay = optax.linear_schedule(cfg.lr, cfg.final_lr, max(total_steps - 1 - cfg.warmup_steps, 1))
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decay_mask(params, decay_embeddings: bool = True):
    """True where weight decay applies: projection matrices (and embeddings, if configured); never norms or
    the λ vectors."""

    def decays(path, _):
        names = [getattr(k, "key", str(k)) for k in path]
        if any(n in EMBEDDING_PARAMS for n in names):
            return decay_embeddings
        return names[-1] == "kernel"

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",), hyperparam_dtype=jnp.float32)(
        learning_rate=schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=lambda p: decay_mask(p, cfg.decay_embeddings))
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw


def applied_learning_rate(opt_state):
    """The learning rate of the last update, as recorded in the optimizer state by `inject_hyperparams`."""
    return optax.tree_utils.tree_get(opt_state, "hyperparams")["learning_rate"]

"""AdamW with the paper's schedule, global-norm clipping and a weight-decay mask, built from Optax parts, with every
number in the optimizer state so one compiled step serves a sweep's members (docs/design.md §3, "Optimizer")."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from diffjax.config import OptimConfig, fields_where
from diffjax.model.archs.diff import LAMBDA_PARAMS

# Parameters named like this are matrices of the embedding family (input table, untied output head).
EMBEDDING_PARAMS = ("embedding", "lm_head")
# OptimConfig field -> the name of its value in the optimizer state (`config.setting`'s `state`)
STATE_NAMES = {k.removeprefix("optim."): name for k, name in fields_where("state").items()}


def schedule_value(step, peak_lr, final_lr, warmup_steps: int, total_steps: int):
    """0 → peak_lr over warmup_steps, then linearly to final_lr, reached by the last update (total_steps − 1).
    The shape is shared; the two values may be traced (one per sweep member)."""
    step = jnp.asarray(step, jnp.float32)
    decay_steps = max(total_steps - 1 - warmup_steps, 1)
    warm = peak_lr * step / max(warmup_steps, 1)
    frac = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    return jnp.where(step < warmup_steps, warm, peak_lr + (final_lr - peak_lr) * frac)


def schedule(cfg: OptimConfig, total_steps: int):
    """The learning rate at each update, as a function of the update count."""
    return lambda step: schedule_value(step, cfg.lr, cfg.final_lr, cfg.warmup_steps, total_steps)


class ScheduleState(NamedTuple):
    count: jax.Array  # int32: updates applied
    peak_lr: jax.Array  # float32
    final_lr: jax.Array  # float32
    last_lr: jax.Array  # float32: the learning rate of the last update (logged)


def scale_by_schedule(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Multiply updates by −lr(count), lr from the paper's schedule with peak / final values held in the state (and
    the λ vectors' by `lambda_lr_scale` too)."""

    def init(params):
        del params
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return ScheduleState(jnp.zeros([], jnp.int32), f32(cfg.lr), f32(cfg.final_lr), f32(0.0))

    def update(updates, state, params=None):
        del params
        lr = schedule_value(state.count, state.peak_lr, state.final_lr, cfg.warmup_steps, total_steps)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        if cfg.lambda_lr_scale != 1:  # λ's vectors: their own multiple of the lr (read from the config each step)
            updates = jax.tree.map(lambda u, is_lambda: u * cfg.lambda_lr_scale if is_lambda else u, updates,
                                   lambda_mask(updates))
        return updates, state._replace(count=optax.safe_increment(state.count), last_lr=lr)

    return optax.GradientTransformation(init, update)


def decay_mask(params, decay_embeddings: bool = True):
    """True where weight decay applies: projection matrices (and embeddings, if configured); never norms or
    the λ vectors."""

    def decays(path, _):
        names = [getattr(k, "key", str(k)) for k in path]
        return decay_embeddings if any(n in EMBEDDING_PARAMS for n in names) else names[-1] == "kernel"

    return jax.tree_util.tree_map_with_path(decays, params)


def lambda_mask(params):
    """True at the λ re-parameterisation vectors (DIFF's lambda_q1 … lambda_k2)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in LAMBDA_PARAMS, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip (if clip_norm > 0) → Adam → decoupled weight decay (masked) → −lr: optax.adamw's chain, with every
    number in the state; then, if `lambda_warmup_steps`, the λ vectors' updates × min(1, update / warm-up)."""
    inject = lambda fn, **static: optax.inject_hyperparams(fn, static_args=tuple(static),  # noqa: E731
                                                           hyperparam_dtype=jnp.float32)
    parts = [inject(optax.clip_by_global_norm)(max_norm=cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts += [inject(optax.scale_by_adam)(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
              inject(optax.add_decayed_weights, mask=True)(weight_decay=cfg.weight_decay,
                                                            mask=lambda p: decay_mask(p, cfg.decay_embeddings)),
              scale_by_schedule(cfg, total_steps)]
    if cfg.lambda_warmup_steps:
        ramp = lambda count: jnp.minimum(1.0, count / cfg.lambda_warmup_steps)  # noqa: E731
        parts.append(optax.masked(optax.scale_by_schedule(ramp), lambda_mask))
    return optax.chain(*parts)


def applied_learning_rate(opt_state):
    """The learning rate of the last update, as recorded in the optimizer state."""
    return optax.tree_utils.tree_get(opt_state, "last_lr")


def set_hyperparams(opt_state, values: OptimConfig | dict):
    """`opt_state` with every numeric hyper-parameter replaced: from an OptimConfig, or a dict keyed by the state
    names (`STATE_NAMES` values) holding float32 arrays, e.g. one sweep member's, traced."""
    if isinstance(values, OptimConfig):
        values = {STATE_NAMES[f]: jnp.asarray(getattr(values, f), jnp.float32) for f in STATE_NAMES}
    present = {k: v for k, v in values.items() if has_hyperparam(opt_state, k)}
    return optax.tree_utils.tree_set(opt_state, **present)


def has_hyperparam(tree, key: str) -> bool:
    missing = object()  # tree_get gives its default for a key the state lacks (max_norm when clip_norm = 0)
    return optax.tree_utils.tree_get(tree, key, default=missing) is not missing

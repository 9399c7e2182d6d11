"""Pure train and eval steps and their jitted, sharded forms (docs/design.md §3, "State, init, steps")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from diffjax import sharding
from diffjax.config import Config
from diffjax.model import DecoderLM, layer_lambdas
from diffjax.model.archs.diff import LAMBDA_RAMP
from diffjax.train.loss import training_token_losses
from diffjax.train.optim import applied_learning_rate
from diffjax.train.state import TrainState
from diffjax.train.telemetry import grad_norms


def token_losses(params, batch, cfg: Config, lambda_init=None):
    """Per-token cross-entropy [B, T] (float32) and the logits."""
    logits = DecoderLM(cfg.model).apply({"params": params}, batch["tokens"], batch["positions"],
                                        batch["segment_ids"], lambda_init=lambda_init)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), logits


def _summed_loss(params, batch, cfg, lambda_init):
    losses = training_token_losses(params, batch, cfg, lambda_init)
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def _microbatches(batch, n: int):
    """[B, ...] -> [n, B/n, ...] taking rows i::n, so every microbatch stays spread over the batch shards."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


def with_lambda_ramp(params, cfg: Config, step):
    """`params` with every layer's λ multiplier at min(1, step / model.lambda_ramp_steps) (as they are without a
    ramp): the train step sets it before its forward, so a resume or a changed N continues the ramp at the step."""
    if not cfg.model.lambda_ramp_steps:
        return params
    ramp = jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / cfg.model.lambda_ramp_steps)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, ramp) if getattr(path[-1], "key", None) == LAMBDA_RAMP else x, params)


def train_step(state: TrainState, batch, *, cfg: Config, tx: optax.GradientTransformation, lambda_init=None):
    """One optimizer step; a non-finite loss or gradient leaves params and optimizer state unchanged and is counted.
    `lambda_init` [n_layers], if given, replaces the config's (a sweep member's constant λ_init, traced)."""
    grad_fn = jax.value_and_grad(_summed_loss, has_aux=True)
    n_micro, params = cfg.optim.grad_accum, with_lambda_ramp(state.params, cfg, state.step)
    if n_micro == 1:
        (loss_sum, count), grads = grad_fn(params, batch, cfg, lambda_init)
    else:
        def accumulate(carry, micro):
            (loss_sum, count), grads = grad_fn(params, micro, cfg, lambda_init)
            return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), None

        zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (loss_sum, count, grads), _ = jax.lax.scan(accumulate, zeros, _microbatches(batch, n_micro))
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    loss = loss_sum / count
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    updates, new_opt_state = tx.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    skipped = (~finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1, params=with_lambda_ramp(keep(new_params, params), cfg, state.step + 1),
        opt_state=keep(new_opt_state, state.opt_state),
        nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1), nonfinite_total=state.nonfinite_total + skipped)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "skipped": skipped,
               "nonfinite_run": new_state.nonfinite_run,
               "lr": applied_learning_rate(new_opt_state), **grad_norms(grads, cfg)}
    lambdas = layer_lambdas(new_state.params, cfg.model, lambda_init)
    if lambdas is not None:
        metrics["lambda"] = lambdas
    return new_state, metrics


def eval_step(params, batch, *, cfg: Config, lambda_init=None):
    """Summed loss, token count, correct argmax predictions, and per-row exact match of all masked targets."""
    losses, logits = token_losses(params, batch, cfg, lambda_init)
    mask = batch["loss_mask"].astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * mask
    has_target = jnp.sum(mask, -1) > 0
    exact = has_target & (jnp.sum(correct, -1) == jnp.sum(mask, -1))
    return {"loss_sum": jnp.sum(losses * mask), "tokens": jnp.sum(mask), "correct": jnp.sum(correct),
            "rows": jnp.sum(has_target), "exact_rows": jnp.sum(exact)}


def jit_eval_step(cfg: Config, mesh, param_shardings):
    return sharding.MeshJit(functools.partial(eval_step, cfg=cfg), mesh,
                            in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                            out_shardings=sharding.replicated(mesh))

"""The train state (a pytree) and its sharded creation: shapes by `jax.eval_shape`, shardings from the logical
axis rules, then a jitted init that writes every array straight into its shards (docs/design.md §3)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from diffjax import sharding
from diffjax.config import Config
from diffjax.model import DecoderLM


@struct.dataclass
class TrainState:
    step: jax.Array  # int32: steps taken, including skipped (non-finite) ones
    params: Any  # float32 master parameters
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key; the model has no dropout, but sweeps and evals draw from it
    nonfinite_run: jax.Array  # int32: consecutive non-finite steps (skipped)
    nonfinite_total: jax.Array  # int32: all skipped steps

    @property
    def updates(self):
        """Optimizer updates applied (the learning-rate schedule's clock)."""
        return self.step - self.nonfinite_total


def make_init(cfg: Config, tx: optax.GradientTransformation):
    """`init(seed) -> TrainState`, pure (jit it, or vmap it over seeds)."""
    model = DecoderLM(cfg.model)

    def init(seed):
        init_rng, rng = jax.random.split(jax.random.PRNGKey(seed))
        params = nn.meta.unbox(model.init(init_rng, jnp.zeros((1, 8), jnp.int32))["params"])
        zero = jnp.zeros((), jnp.int32)
        return TrainState(step=zero, params=params, opt_state=tx.init(params), rng=rng, nonfinite_run=zero,
                          nonfinite_total=zero)

    return init


def state_shardings(cfg: Config, mesh, tx: optax.GradientTransformation):
    """(abstract TrainState with shardings attached, TrainState of NamedShardings)."""
    abstract = jax.eval_shape(make_init(cfg, tx), 0)
    boxed = jax.eval_shape(lambda: DecoderLM(cfg.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    p_shard = sharding.param_shardings(boxed["params"], mesh)
    rep = sharding.replicated(mesh)
    o_shard = optax.tree_map_params(tx, lambda _, s: s, abstract.opt_state, p_shard,
                                    transform_non_params=lambda _: rep)
    shardings = TrainState(step=rep, params=p_shard, opt_state=o_shard, rng=rep, nonfinite_run=rep,
                           nonfinite_total=rep)
    with_shardings = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract, shardings)
    return with_shardings, shardings


def init_state(cfg: Config, tx: optax.GradientTransformation, shardings) -> TrainState:
    """A fresh TrainState from cfg.train.seed, each array created directly in its shards."""
    return jax.jit(make_init(cfg, tx), static_argnums=0, out_shardings=shardings)(cfg.train.seed)

"""Protocol "validation": loss, perplexity, token accuracy and exact match on the validation split — the same
evaluator the training loop runs every `train.eval_every` steps (`diffjax.train.validation`)."""

from __future__ import annotations

import jax

from diffjax import sharding
from diffjax.config import Config, MeshConfig
from diffjax.eval import Protocol, register
from diffjax.train.validation import Validation


def run(cfg: Config, params, *, mesh=None) -> dict:
    """Validation metrics of `params` over `train.eval_batches` batches; `mesh` defaults to the params' own."""
    if mesh is None:
        leaf = jax.tree.leaves(params)[0]
        mesh = getattr(leaf.sharding, "mesh", None) or sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    return Validation(cfg, mesh, jax.tree.map(lambda x: x.sharding, params))(params)


register(Protocol("validation", run))

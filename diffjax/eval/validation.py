"""Protocol "validation": loss, perplexity, token accuracy and exact match on the validation split — the same
evaluator the training loop runs every `train.eval_every` steps (`diffjax.train.validation`)."""

from __future__ import annotations

import jax

from diffjax import sharding
from diffjax.config import Config
from diffjax.eval import Protocol, register
from diffjax.train.validation import Validation


def run(cfg: Config, params, *, mesh=None) -> dict:
    """Validation metrics of `params` over `train.eval_batches` batches; `mesh` defaults to the params' own."""
    mesh = sharding.mesh_of(params) if mesh is None else mesh
    return Validation(cfg, mesh, jax.tree.map(lambda x: x.sharding, params))(params)


register(Protocol("validation", run))

"""Protocol "validation": the training loop's validation metrics (`diffjax.train.validation`) of a checkpoint."""

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

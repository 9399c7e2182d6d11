"""`load_run`: how every reader of a run (eval, lm-eval, generate, `hf export`, notebooks, studies) restores it, through
`Checkpointer.restore_latest` as training's resume does, writing nothing (docs/design.md §3, "Checkpoints")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from diffjax import config as config_lib
from diffjax import paths, sharding
from diffjax.config import Config, ConfigError, MeshConfig
from diffjax.train import run_config
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.optim import make_optimizer
from diffjax.train.state import state_shardings


def load_run(workdir: str | Path, overrides=(), *, step: int | None = None,
             params_only: bool = False) -> tuple[Config, object, jax.sharding.Mesh]:
    """(config, TrainState, mesh) of run `workdir`'s newest readable checkpoint, or of checkpoint `step`; the params
    alone in the state's place if `params_only`. `overrides` apply to the run's config (`mesh.*`: another mesh). On
    this process's devices: each process of a launch restores the whole state (docs/design.md §3, "Multi-host")."""
    workdir = paths.run_dir(workdir)
    cfg = run_config.load(workdir)
    if jax.process_count() > 1:  # the run's mesh spans processes; this one's devices hold the params (fsdp)
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=-1))
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    mesh = sharding.make_mesh(cfg.mesh, jax.local_devices())
    abstract, _ = state_shardings(cfg, mesh, make_optimizer(cfg.optim, cfg.train.steps))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints, read_only=True)
    try:
        steps = ckpt.manager.all_steps()
        if step is not None and step not in steps:
            raise ConfigError(f"--step {step}: {workdir / 'checkpoints'} holds steps {sorted(steps)}")
        restored = ckpt.restore_latest(abstract, data=False, step=step, params_only=params_only)
    finally:  # a refused restore too: Orbax's threads end here, not in tracebacks at exit
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{workdir / 'checkpoints'} holds no readable checkpoint")
    return cfg, restored[1], mesh

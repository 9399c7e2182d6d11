"""Sweep step probe: what one training step of bench_sweep.py's 8 members costs under each way of stepping them,
in one process, interleaved rounds (so a busy machine slows every arm alike):

    python experiments/bench_sweep_step.py [--rounds 7] [--steps 5] [--json out.json]

- `vmap`: the sweep's vmapped group step (`sweep.execution=vmap`);
- `serial`: the sweep's serial group step — `jax.lax.map` over the members inside one jitted program;
- `loop`: the unbatched member step, jitted once, called for each member in a Python loop over per-member states
  (the alternative to `serial`; its best case: a runner would also have to slice and restack the members);
- `alone`: `diffjax train`'s own jitted step, called 8 times on one state (what sequential runs pay per step).

Per arm: the first call (compilation included) and the median over rounds of ms per member-step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
from bench_sweep import bench_sweep  # this directory is on sys.path when the script runs
from benchenv import emit

from diffjax import sharding
from diffjax.sweep import SweepOptions
from diffjax.sweep.runner import ChunkRun
from diffjax.train.state import init_state, state_shardings
from diffjax.train.step import jit_train_step, train_step


def arms(sweep, workdir: Path) -> dict:
    """name -> (state, step: state -> state), each step taking all the members one step."""
    out = {}
    for execution in ("vmap", "serial"):
        chunk = ChunkRun(dataclasses.replace(sweep, options=SweepOptions(execution=execution)), list(sweep.members),
                         workdir, workdir / execution)
        batch, fn, lam = chunk._batch(chunk._iterators()), chunk._train_fn(), chunk.lambda_init
        out[execution] = (chunk._init(), lambda full, fn=fn, batch=batch, lam=lam: fn(full, batch, lam)[0])
    # loop: the same members (numbers, λ_init, batch), each its own state, stepped in turn
    cfg, tx, n = chunk.cfg, chunk.tx, chunk.n
    stacked = chunk._init()["train"]
    one = jax.jit(lambda state, batch, lam: train_step(state, batch, cfg=cfg, tx=tx, lambda_init=lam)[0],
                  donate_argnums=0)
    lams = [chunk.lambda_init[i] for i in range(n)]
    out["loop"] = ([jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)],
                   lambda states: [one(s, batch, lam) for s, lam in zip(states, lams, strict=True)])
    # alone: the single run's step on its own mesh, n times
    mesh = sharding.make_mesh(cfg.mesh)
    _, shardings = state_shardings(cfg, mesh, tx)
    alone, single = jit_train_step(cfg, tx, mesh, shardings), sharding.put_batch(jax.device_get(batch), mesh)

    def n_steps(state):
        for _ in range(n):
            state = alone(state, single)[0]
        return state

    out["alone"] = (init_state(cfg, tx, shardings), n_steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="group steps per arm per round")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    sweep = bench_sweep(args.steps)
    n = len(sweep.members)
    states, steps, first, per_member_step = {}, {}, {}, {}
    for name, (state, step) in arms(sweep, Path(tempfile.mkdtemp(prefix="bench_sweep_step_"))).items():
        t0 = time.perf_counter()
        states[name], steps[name] = jax.block_until_ready(step(state)), step
        first[name], per_member_step[name] = time.perf_counter() - t0, []
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[name] = step(states[name])
            jax.block_until_ready(states[name])
            per_member_step[name].append((time.perf_counter() - t0) / (args.steps * n))
    ms = {name: 1e3 * statistics.median(t) for name, t in per_member_step.items()}
    out = {"members": n, "rounds": args.rounds, "steps_per_round": args.steps, "first_call_s": first,
           "ms_per_member_step": ms, "relative_to_alone": {k: v / ms["alone"] for k, v in ms.items()}}
    return emit(out, args.json)


if __name__ == "__main__":
    from diffjax import host

    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    sys.exit(main())

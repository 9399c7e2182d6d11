"""Sweep benchmark: 8 members of a tiny config (4 learning rates × 2 seeds), (a) one `diffjax sweep` group under
each `sweep.execution` asked for vs (b) the same 8 configs trained one after another by `diffjax train`'s loop, all
in one process, in that order (docs/benchmarks.md, "Sweep").

    python experiments/bench_sweep.py [--steps 60] [--execution serial,vmap] [--json out.json]
    python experiments/bench_sweep.py --steps 600          # the long configuration
    python experiments/bench_sweep.py --per-step [--rounds 7] [--steps 5]    # one step's cost under each stepping

`ratio` = wall(a) / wall(b), compilation and the final evaluation and checkpoint included; `steady_s` is the steps'
time at the steady tokens/s the loops log, `fixed_s` = wall − steady_s the rest. `--per-step`: the first call and the
median ms per member-step of each way of stepping the 8 members, in interleaved rounds: `vmap` and `serial` (the
sweep's group steps), `loop` (the member step jitted once, called per member in Python: `serial`'s alternative at
its best), `alone` (`diffjax train`'s step called 8 times on one state, as sequential runs pay).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
from benchlib import emit

from diffjax import config as config_lib
from diffjax import sharding
from diffjax.sweep import Sweep, SweepOptions, product
from diffjax.sweep.runner import chunk_members, run_sweep
from diffjax.sweep.spec import EXECUTIONS
from diffjax.train.loop import train
from diffjax.train.members import Members, Stack
from diffjax.train.metrics import read_metrics
from diffjax.train.step import train_step

TINY = ["model.d_model=64", "model.n_heads=2", "model.head_dim=16", "model.n_layers=2", "data.seq_len=128",
        "data.batch_size=8", "data.tasks=mqar", "train.log_every=10", "train.eval_batches=1",
        "optim.warmup_steps=5", "mesh.data=1"]


def bench_sweep(steps: int) -> Sweep:
    """The benchmark's 8 members, `steps` steps each (checkpoints and evaluation only at the end)."""
    base = config_lib.load("configs/small.py:size=tiny,arch=diff",
                           TINY + [f"train.steps={steps}", f"train.eval_every={steps}",
                                   f"train.checkpoint_every={steps}"])
    return Sweep.build(base, *product({"optim.lr": [5e-4, 1e-3, 2e-3, 4e-3]}), seeds=2, name="bench")


def steady_tokens_per_s(directories) -> float:
    """Median over logged steps of tokens/s, as the loop measured it (for a sweep group: all its members)."""
    return statistics.median(r["tokens_per_s"] for d in directories for r in read_metrics(d) if r["split"] == "train")


def executions(text: str) -> list[str]:
    """`--execution`: each timed sweep's execution, named ("auto" would hide which one was timed)."""
    names, known = [e for e in text.split(",") if e], [e for e in EXECUTIONS if e != "auto"]
    if not names or any(e not in known for e in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {known}, got {text!r}")
    return names


def arms(sweep, workdir: Path) -> dict:
    """name -> (state, step: state -> state), each step taking all the members one step."""
    out = {}
    for execution in ("vmap", "serial"):
        stack = Stack.build(chunk_members(dataclasses.replace(sweep, options=SweepOptions(execution=execution)),
                                          list(sweep.members), workdir, workdir / execution))
        batch, fn = stack.put_batch([it.next() for it in stack.iterators()]), stack.train_fn()
        out[execution] = (stack.init(), lambda full, fn=fn, batch=batch: fn(full, batch)[0])
    # loop: the same members (numbers, λ_init, batch), each its own state, stepped in turn
    cfg, tx, n = stack.cfg, stack.tx, stack.n
    stacked = stack.init()["train"]
    one = jax.jit(lambda state, batch, lam: train_step(state, batch, cfg=cfg, tx=tx, lambda_init=lam)[0],
                  donate_argnums=0)
    lams = [stack.lambda_init[i] for i in range(n)]
    out["loop"] = ([jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)],
                   lambda states: [one(s, batch, lam) for s, lam in zip(states, lams, strict=True)])
    # alone: the single run's step (a stack of one) on its own mesh, n times
    alone = Stack.build(Members.run(cfg, workdir / "alone"))
    step, single = alone.train_fn(), sharding.put_batch(jax.device_get(batch), alone.mesh)

    def n_steps(state):
        for _ in range(n):
            state = step(state, single)[0]
        return state

    out["alone"] = (alone.init(), n_steps)
    return out


def per_step(steps: int, rounds: int) -> dict:
    """`--per-step`: ms per member-step of each arm of `arms`, the median over interleaved rounds."""
    sweep = bench_sweep(steps)
    n = len(sweep.members)
    states, step_fns, first, per_member_step = {}, {}, {}, {}
    for name, (state, step) in arms(sweep, Path(tempfile.mkdtemp(prefix="bench_sweep_step_"))).items():
        t0 = time.perf_counter()
        states[name], step_fns[name] = jax.block_until_ready(step(state)), step
        first[name], per_member_step[name] = time.perf_counter() - t0, []
    for _ in range(rounds):
        for name, step in step_fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                states[name] = step(states[name])
            jax.block_until_ready(states[name])
            per_member_step[name].append((time.perf_counter() - t0) / (steps * n))
    ms = {name: 1e3 * statistics.median(t) for name, t in per_member_step.items()}
    return {"members": n, "rounds": rounds, "steps_per_round": steps, "first_call_s": first,
            "ms_per_member_step": ms, "relative_to_alone": {k: v / ms["alone"] for k, v in ms.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--execution", type=executions, default=["serial", "vmap"],
                   help="the sweep executions to time, in this order (default: serial,vmap)")
    p.add_argument("--per-step", action="store_true", help="time one step under each way of stepping the members")
    p.add_argument("--rounds", type=int, default=7, help="--per-step: interleaved rounds")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.per_step:
        return emit(per_step(args.steps, args.rounds), args.json)
    sweep = bench_sweep(args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    tokens_per_step = sweep.base.data.batch_size * sweep.base.data.seq_len
    member_steps = len(sweep.members) * args.steps

    def figures(wall_s: float, tokens_per_s: float) -> dict:
        steady_s = member_steps * tokens_per_step / tokens_per_s
        return {"wall_s": wall_s, "tokens_per_s": tokens_per_s, "steady_s": steady_s, "fixed_s": wall_s - steady_s}

    sweeps = {}
    for execution in args.execution:
        t0 = time.perf_counter()
        run_sweep(dataclasses.replace(sweep, options=SweepOptions(execution=execution)), tmp / execution,
                  progress=False)
        wall = time.perf_counter() - t0
        sweeps[execution] = figures(wall, steady_tokens_per_s([tmp / execution / "members" / sweep.members[0].name]))
    t0 = time.perf_counter()
    for m in sweep.members:
        train(m.config, tmp / "seq" / m.name, progress=False)
    sequential = figures(time.perf_counter() - t0,
                         statistics.median(steady_tokens_per_s([tmp / "seq" / m.name]) for m in sweep.members))
    for figs in sweeps.values():
        figs.update(ratio=figs["wall_s"] / sequential["wall_s"],
                    throughput_ratio=figs["tokens_per_s"] / sequential["tokens_per_s"])

    out = {"members": len(sweep.members), "steps": args.steps, "tokens_per_step_per_member": tokens_per_step,
           "sweep": sweeps, "sequential": sequential, "order": [*args.execution, "sequential"],
           "jax_devices": str(jax.devices()[:1])}
    return emit(out, args.json)


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

"""Sweep benchmark: 8 members of a tiny config (4 learning rates × 2 seeds), (a) one `diffjax sweep` group under
each `sweep.execution` asked for (vmap: one batched program; serial: the members looped inside one program) vs
(b) the same 8 configs trained one after another by `diffjax train`'s loop — all in one process, in that order.

    python experiments/bench_sweep.py [--steps 60] [--execution serial,vmap] [--json out.json]
    python experiments/bench_sweep.py --steps 600          # the long configuration

Wall time includes compilation and everything the loops do (checkpoints and evaluation are pushed past the last
step but the final ones run in both); steady-state tokens/s is measured from the metrics both write (the loops'
own clock, which starts after the first step). `ratio` = wall(a) / wall(b). `steady_s` is the time the steps take at
that steady rate; `fixed_s` = wall − steady_s is the rest (compilation, init, first step, data, final validation and
checkpoint): the sweep saves fixed time, and pays or gains per step. Run with nothing else on the machine.
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
from benchenv import emit  # this directory is on sys.path when the script runs

from diffjax import config as config_lib
from diffjax.sweep import Sweep, SweepOptions, product
from diffjax.sweep.runner import run_sweep
from diffjax.sweep.spec import EXECUTIONS
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics

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
    rates = [r["tokens_per_s"] for d in directories for r in read_metrics(d) if r["split"] == "train"]
    return statistics.median(rates)


def executions(text: str) -> list[str]:
    """`--execution`: what each timed sweep runs, named ("auto" would hide which one was timed)."""
    names, known = [e for e in text.split(",") if e], [e for e in EXECUTIONS if e != "auto"]
    if not names or any(e not in known for e in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {known}, got {text!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--execution", type=executions, default=["serial", "vmap"],
                   help="the sweep executions to time, in this order (default: serial,vmap)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    sweep = bench_sweep(args.steps)
    base = sweep.base
    tmp = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    tokens_per_step = base.data.batch_size * base.data.seq_len
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
        figs["ratio"] = figs["wall_s"] / sequential["wall_s"]
        figs["throughput_ratio"] = figs["tokens_per_s"] / sequential["tokens_per_s"]

    out = {"members": len(sweep.members), "steps": args.steps, "tokens_per_step_per_member": tokens_per_step,
           "sweep": sweeps, "sequential": sequential, "order": [*args.execution, "sequential"],
           "jax_devices": str(jax.devices()[:1])}
    return emit(out, args.json)


if __name__ == "__main__":
    from diffjax import host

    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    sys.exit(main())

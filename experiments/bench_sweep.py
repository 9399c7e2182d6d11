"""Sweep benchmark: 8 members of a tiny config (4 learning rates × 2 seeds), (a) one vmapped `diffjax sweep`
group vs (b) the same 8 configs trained one after another by `diffjax train`'s loop, in one process.

    python experiments/bench_sweep.py [--steps 60] [--json out.json]

Wall time includes compilation and everything the loops do (checkpoints and evaluation are pushed past the last
step but the final ones run in both); steady-state tokens/s is measured from the metrics both write (the loops'
own clock, which starts after the first step). `ratio` = wall(a) / wall(b). Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
from benchenv import cpu_model, versions  # this directory is on sys.path when the script runs

from diffjax import config as config_lib
from diffjax.sweep import Sweep, product
from diffjax.sweep.runner import run_sweep
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics

TINY = ["model.d_model=64", "model.n_heads=2", "model.head_dim=16", "model.n_layers=2", "data.seq_len=128",
        "data.batch_size=8", "data.tasks=mqar", "train.log_every=10", "train.eval_batches=1",
        "optim.warmup_steps=5", "mesh.data=1"]


def steady_tokens_per_s(directories) -> float:
    """Median over logged steps of tokens/s, as the loop measured it (for a sweep group: all its members)."""
    rates = [r["tokens_per_s"] for d in directories for r in read_metrics(d) if r["split"] == "train"]
    return statistics.median(rates)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    base = config_lib.load("configs/small.py:size=tiny,arch=diff",
                           TINY + [f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                                   f"train.checkpoint_every={args.steps}"])
    sweep = Sweep.build(base, *product({"optim.lr": [5e-4, 1e-3, 2e-3, 4e-3]}), seeds=2, name="bench")
    tmp = Path(tempfile.mkdtemp(prefix="bench_sweep_"))

    t0 = time.perf_counter()
    run_sweep(sweep, tmp / "sweep", progress=False)
    vmapped_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in sweep.members:
        train(m.config, tmp / "seq" / m.name, progress=False)
    sequential_s = time.perf_counter() - t0

    one_member = steady_tokens_per_s([tmp / "sweep" / "members" / sweep.members[0].name])  # group throughput
    alone = statistics.median(steady_tokens_per_s([tmp / "seq" / m.name]) for m in sweep.members)
    out = {"members": len(sweep.members), "steps": args.steps, "tokens_per_step_per_member":
           base.data.batch_size * base.data.seq_len, "vmapped_wall_s": vmapped_s, "sequential_wall_s": sequential_s,
           "ratio": vmapped_s / sequential_s, "vmapped_group_tokens_per_s": one_member,
           "sequential_run_tokens_per_s": alone, "throughput_ratio": one_member / alone,
           "device": cpu_model(), "jax_devices": str(jax.devices()[:1]),
           "versions": versions("jax", "jaxlib", "flax", "optax", "numpy")}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of evaluation against training's, for one context-parallel run (issue #33's case).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench_eval_memory.py --seq-len 1024
    ... --seq-len 4096 --protocols retrieval,attention_noise,validation,position_loss --json out.json

Trains a tiny DIFF with `mesh.context=8` for a few steps, then runs the end of `diffjax train` and each protocol,
reading the process's peak resident size after each: a peak above training's is evaluation's (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from pathlib import Path

from benchlib import emit


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure(seq_len: int, protocols: list[str], steps: int = 2, context: int = 8) -> dict:
    from diffjax import checks
    from diffjax import eval as eval_lib
    from diffjax.eval.report import write_report
    from diffjax.train.loop import train
    from diffjax.train.run_loader import load_run

    cfg = checks.load("configs/small.py:size=tiny,arch=diff",
                      [f"data.seq_len={seq_len}", "data.batch_size=2", "mesh.data=1", f"mesh.context={context}",
                       f"train.steps={steps}", "train.eval_batches=1", "train.eval_every=1000"])
    with tempfile.TemporaryDirectory() as workdir:
        train(cfg, Path(workdir), progress=False)
        out = {"seq_len": seq_len, "context": context, "train_peak_gib": peak_gib(), "after": {}}
        _, state, _ = load_run(workdir)
        retrieval = eval_lib.get("retrieval").run(cfg, state.params)
        out["after"]["retrieval (end of diffjax train)"] = peak_gib()
        write_report(workdir, cfg, state.params, retrieval=retrieval)
        out["after"]["report.png (end of diffjax train)"] = peak_gib()
        for name in protocols:
            eval_lib.get(name).run(cfg, state.params)
            out["after"][name] = peak_gib()
    out["eval_over_train"] = max(out["after"].values()) / out["train_peak_gib"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--protocols", default="attention_noise,validation", help="protocols run after the end of run")
    p.add_argument("--json")
    args = p.parse_args(argv)
    return emit(measure(args.seq_len, [n for n in args.protocols.split(",") if n], args.steps), args.json)


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

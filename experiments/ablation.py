"""Table 6 of the paper from the ablation sweep (configs/ablation.py; the analysis is diffjax/studies/ablation.py).

    python experiments/ablation.py --sweep runs/sweeps/ablation-cpu                       # read a finished sweep
    python experiments/ablation.py --run --data corpus.txt [--seeds 3] [--set train.steps=400]   # run it first
    python experiments/ablation.py --run --data corpus.txt --rows transformer+diff --baselines gated+sink+dint
    python experiments/ablation.py --sweep runs/sweeps/later-row --join runs/sweeps/ablation-cpu   # rows together

Writes ablation.md, ablation.csv and ablation.json into the sweep directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffjax.config import ConfigError
from diffjax.studies import ablation


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", type=Path, help="a sweep directory of configs/ablation.py")
    p.add_argument("--run", action="store_true", help="run the sweep first (needs --data)")
    p.add_argument("--data", help="corpus path for --run")
    p.add_argument("--scale", default="cpu")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rows", default="", help="Table 6 rows to run, '+'-joined (default: all)")
    p.add_argument("--baselines", default="", help="attention baselines as extra rows, e.g. gated+sink+dint")
    p.add_argument("--set", action="append", default=[], help="overrides passed to diffjax sweep")
    p.add_argument("--batches", type=int, default=8, help="validation batches per member")
    p.add_argument("--join", type=Path, action="append", default=[],
                   help="a finished sweep of the same recipe whose rows join the tables (repeatable)")
    args = p.parse_args(argv)
    sweep_dir = args.sweep or Path(f"runs/sweeps/ablation-{args.scale}")
    if args.run:
        if not args.data:
            p.error("--run needs --data")
        if not ablation.run_sweep(args.data, sweep_dir=sweep_dir, scale=args.scale, seeds=args.seeds,
                                  rows=args.rows, baselines=args.baselines, overrides=args.set):
            return 130
    if not (sweep_dir / "sweep.json").exists():
        raise ConfigError(f"{sweep_dir} is not a sweep directory (give --sweep, or --run --data)")
    print(ablation.report(sweep_dir, args.batches, tuple(args.join)))
    return 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

"""Fig. 3 of the paper from scaling sweeps (configs/scaling.py; the analysis is diffjax/studies/scaling.py): power-law
fits per arch and "DIFF matches the Transformer at x % of the parameters / tokens", with an uncertainty from the seeds.

    python experiments/scaling.py --size-sweep runs/sweeps/scaling-size-cpu --token-sweep runs/sweeps/scaling-tokens-cpu
    python experiments/scaling.py --run --data corpus.txt [--seeds 3]     # run both CPU sweeps first, then report

Writes scaling.json, scaling.md and scaling.png next to the first sweep (or --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffjax.studies import scaling


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-sweep", type=Path)
    p.add_argument("--token-sweep", type=Path)
    p.add_argument("--run", action="store_true", help="run the CPU sweeps first (needs --data)")
    p.add_argument("--data", help="text corpus for --run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.run:
        if not args.data:
            p.error("--run needs --data")
        args.size_sweep = scaling.run_sweep("size", args.data, seeds=args.seeds, sweep_dir=args.size_sweep)
        args.token_sweep = args.size_sweep and scaling.run_sweep("tokens", args.data, seeds=args.seeds,
                                                                 sweep_dir=args.token_sweep)
        if not args.token_sweep:
            return 130
    if not (args.size_sweep or args.token_sweep):
        p.error("give --size-sweep and/or --token-sweep (or --run --data)")
    print(scaling.report(args.size_sweep, args.token_sweep, args.out))
    return 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

"""Fig. 8 of the paper at CPU scale over seeds (the analysis is diffjax/studies/quantization.py): DIFF against the
Transformer with absmax-quantized attention logits at 16 / 8 / 6 / 4 bits, per tensor, head and query row, DIFF's
two maps by their own scales or one shared scale, and per layer the error this puts into the attention map.

    python experiments/quantization_study.py --run --data wikitext-2/valid.txt    # train what is missing, then report
    python experiments/quantization_study.py --retrieval runs/main --text runs/sweeps/ablation-cpu

Tasks: "retrieval", the main job's runs (`diffjax train`: runs/main, 3 seeds per arch), and "text", the DIFF and
Transformer rows of the Table 6 ablation at CPU scale on a text corpus (configs/ablation.py, 3 seeds). `--run` trains
or resumes both sweeps first. Writes quantization.{md,json,csv,png} into --out; each member's results are kept as
they finish, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffjax import sweep as sweep_lib
from diffjax.kernels.quantized import GRANULARITIES
from diffjax.studies import ablation, quantization


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--retrieval", type=Path, default=Path("runs/main"), help="the main job's sweep directory")
    p.add_argument("--text", type=Path, default=Path("runs/sweeps/ablation-cpu"),
                   help="a configs/ablation.py sweep with the diff and transformer rows")
    p.add_argument("--run", action="store_true", help="train (or resume) both sweeps first; needs --data")
    p.add_argument("--data", help="the text corpus for --run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="overrides for both sweeps (with --run)")
    p.add_argument("--out", type=Path, default=Path("runs/studies/quantization"))
    p.add_argument("--batches", type=int, default=8, help="validation batches per member")
    p.add_argument("--retrieval-n", type=int, default=64, help="retrieval examples per depth")
    p.add_argument("--bits", default=",".join(map(str, quantization.BITS)), help="bit widths, 16 among them")
    p.add_argument("--granularities", default=",".join(GRANULARITIES))
    args = p.parse_args(argv)
    if args.run:
        if not args.data:
            p.error("--run needs --data")
        if not sweep_lib.run(f"configs/main.py:seeds={args.seeds}", args.set, args.retrieval, progress=False):
            return 130
        if not ablation.run_sweep(args.data, sweep_dir=args.text, seeds=args.seeds, rows="transformer+diff",
                                  overrides=tuple(args.set)):
            return 130
    tasks = {name: path for name, path in (("retrieval", args.retrieval), ("text", args.text)) if path.exists()}
    if not tasks:
        p.error(f"neither {args.retrieval} nor {args.text} exists (train them, or --run --data CORPUS)")
    print(quantization.report(tasks, args.out, batches=args.batches, retrieval_n=args.retrieval_n,
                              bits=tuple(int(b) for b in args.bits.split(",")),
                              granularities=tuple(args.granularities.split(","))))
    return 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

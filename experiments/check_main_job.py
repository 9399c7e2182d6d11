"""Does a fresh main job agree with the README's table? Names every cell outside it by more than the seed spread
(an arch's mean beyond the README's mean ± std over seeds, a paired difference beyond its 95 % CI).

    make train && python experiments/check_main_job.py            # exit 1 when a cell disagrees
"""

import argparse
from pathlib import Path

from diffjax.main_job import disagreements


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", type=Path, default=Path("runs/main/summary.md"), help="the fresh run's table")
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    args = p.parse_args(argv)
    found = disagreements(args.readme.read_text(), args.summary.read_text())
    print("\n".join(found) if found else f"{args.summary} agrees with {args.readme}'s table within the seed spread")
    return 1 if found else 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

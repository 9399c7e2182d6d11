"""`diffjax summary --config FILE[:ARG] [--set a.b=c ...] [--json]`."""

from __future__ import annotations

import argparse
import json

from diffjax import config as config_lib
from diffjax.flops import train_flops_per_token
from diffjax.model import lambda_inits, param_count


def summary(cfg: config_lib.Config) -> dict:
    m = cfg.model
    counts = param_count(m)
    return {"name": cfg.name, "arch": m.arch, **counts,
            "lambda_init": [float(x) for x in lambda_inits(m)] if m.arch == "diff" else [],
            "flops_per_token": train_flops_per_token(m, cfg.data.seq_len)}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="diffjax")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="parameters, λ_init per layer and training FLOPs per token")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, args.set)
    info = summary(cfg)
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:>18}: {v}")


if __name__ == "__main__":
    main()

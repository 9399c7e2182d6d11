"""The paper's Table 6 ablation as one sweep: seven rows × seeds.

    diffjax sweep --config configs/ablation.py:scale=cpu,data=path/to/wikitext2_train.txt,seeds=3
    diffjax sweep --config configs/ablation.py:scale=paper,data=corpus_shards/ --set mesh.fsdp=8
    python experiments/ablation.py --sweep runs/sweeps/ablation-cpu      # the Table 6-shaped table

Rows: Table 6's seven (`rows()`), and beyond the paper `diff_v2` and `diff-split`, trained when named. The DIFF rows
that differ only in λ_init form one group, one program; the other rows are groups of their own.

- `scale=paper`: Table 10's 1.4B model, Appendix E's recipe exactly; `data=`: `diffjax prepare` shards or text.
- `scale=cpu`: a 4-layer, d_model 128 model with the byte tokenizer on a text file, sized so the whole sweep (21
  members with 3 seeds) runs in well under an hour on a 2-core CPU.
Arguments: scale (cpu | paper), data (a path; required), seeds (default 3), steps (default: the scale's),
rows (default Table 6's seven: the rows to train, joined by '+', e.g. transformer+diff+diff_v2), baselines (default
none: any registered archs joined by '+', e.g. gated+sink+dint, each parameter-matched to the DIFF row as in
docs/design.md §2, as extra rows).
"""

import dataclasses

from diffjax import recipes
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.sweep import Sweep, variants


def rows(h: int, d: int) -> dict[str, dict]:
    """Table 6's seven rows for a DIFF model with h heads of d (overrides of a DIFF base config)."""
    transformer = {"model.arch": "transformer", "model.n_heads": 2 * h, "model.head_dim": d}
    wide = {"model.arch": "transformer", "model.n_heads": h, "model.head_dim": 2 * d}
    return {
        "transformer": transformer,
        "transformer-wide": wide,
        "transformer-wide+gn": {**wide, "model.headwise_norm": True},
        "diff": {},
        "diff-gn": {"model.headwise_norm": False},
        "diff-lambda0.8": {"model.lambda_init": 0.8},
        "diff-lambda0.5": {"model.lambda_init": 0.5},
        # DIFF V2 with DIFF's h and d: fewer attention parameters than V1, so not matched (`diffjax summary`)
        "diff_v2": {"model.arch": "diff_v2"},
        # the layout some reproductions use (microsoft/unilm #1663): the Transformer's 2h heads kept, its head of d
        # split into q1/q2 (k1/k2) halves of d/2, V of d — the same attention parameters as DIFF's h heads of d
        "diff-split": {"model.n_heads": 2 * h, "model.head_dim": d // 2},
    }


def get_sweep(arg: str = "") -> Sweep:
    args = recipes.parse_args(arg, "configs/ablation.py", {"scale": "cpu", "data": "", "seeds": "3", "steps": "",
                                                                          "rows": "", "baselines": ""})
    if not args["data"]:
        raise ConfigError("configs/ablation.py: needs data=<path> (a text file / directory, or prepared shards)")
    source = recipes.data_source(args["data"])
    if args["scale"] == "paper":
        model = recipes.model_config("1.4B", "diff", **recipes.PAPER_SCALE)
        optim, data, train = recipes.paper_recipe("1.4B")
        data = dataclasses.replace(data, source=source, path=args["data"])
        train = TrainConfig(steps=int(args["steps"] or train.steps), eval_every=2000, eval_batches=32,
                            checkpoint_every=1000, log_every=50)
    elif args["scale"] == "cpu":
        model = ModelConfig(arch="diff", vocab_size=recipes.BYTE_VOCAB, d_model=128, n_layers=4, n_heads=2,
                            head_dim=32, dtype="float32")
        optim = OptimConfig(lr=2e-3, final_lr=2e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
        data = DataConfig(source=source, path=args["data"], tokenizer="byte", seq_len=128, batch_size=16)
        train = TrainConfig(steps=int(args["steps"] or 600), log_every=20, eval_every=200, eval_batches=8,
                            checkpoint_every=200)
    else:
        raise ConfigError(f"configs/ablation.py: scale must be cpu or paper, got {args['scale']!r}")
    base = Config(model=model, data=data, optim=optim, train=train, name=f"ablation-{args['scale']}")
    baselines = recipes.baseline_rows(args["baselines"], "configs/ablation.py", model)
    table = rows(model.n_heads, model.head_dim)
    return Sweep.build(base, variants(selected(table, args["rows"]) | baselines), seeds=int(args["seeds"]))


BEYOND_THE_PAPER = {"diff_v2", "diff-split"}  # rows trained only when named (rows=...+diff_v2)


def selected(table: dict[str, dict], names: str) -> dict[str, dict]:
    """The rows named in `names` ('+'-joined; empty: Table 6's seven), in Table 6's order."""
    wanted = set(names.split("+")) if names else set(table) - BEYOND_THE_PAPER
    if unknown := sorted(wanted - set(table)):
        raise ConfigError(f"configs/ablation.py: rows: unknown {unknown}; choose from {'+'.join(table)}")
    return {name: overrides for name, overrides in table.items() if name in wanted}

"""The paper's Fig. 3 scaling studies as sweeps: model size (3a) and training tokens (3b), both archs.

    diffjax sweep --config configs/scaling.py:study=size,scale=cpu,data=path/to/corpus.txt,seeds=3
    diffjax sweep --config configs/scaling.py:study=tokens,scale=cpu,data=path/to/corpus.txt,seeds=3
    python experiments/scaling.py --size-sweep runs/sweeps/scaling-size-cpu --token-sweep runs/sweeps/scaling-tokens-cpu

- `scale=paper`: sizes 830M … 13.1B (Table 10) with Appendix E's recipe, each size × arch its own group; the token
  study: Table 9's 3B model and recipe, validated every 10k steps up to 90k (where Fig. 3b reads the loss).
- `scale=cpu`: four sizes spanning > 10× in parameters (`CPU_SIZES`); the token study on the middle one.
Arguments: study (size | tokens), scale (cpu | paper), data (path; required), seeds (default 3), steps, sizes (a
subset joined by "+", e.g. xs+s; default all), archs (default diff+transformer, e.g. diff+transformer+gated+dint;
each matched in parameters to the DIFF model of every size, docs/design.md §2).
"""

import dataclasses

from diffjax import recipes
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.model import archs
from diffjax.sweep import Sweep, variants

# CPU sizes: (d_model, layers, DIFF heads h, head dim d); the Transformer has 2h heads of d (same parameters)
CPU_SIZES = {"xs": (64, 2, 1, 32), "s": (96, 3, 1, 48), "m": (160, 3, 2, 40), "l": (256, 4, 2, 64)}
PAPER_SIZES = ("830M", "1.4B", "2.8B", "6.8B", "13.1B")


def _archs(arg: str) -> tuple[str, ...]:
    names = tuple(filter(None, arg.split("+")))
    if unknown := [n for n in names if n not in archs.names()]:
        raise ConfigError(f"configs/scaling.py: archs: unknown {unknown}; registered: {'+'.join(archs.names())}")
    if len(set(names)) != len(names) or len(names) < 2:
        raise ConfigError(f"configs/scaling.py: archs: at least two distinct archs joined by '+', got {arg!r}")
    return names


def get_sweep(arg: str = "") -> Sweep:
    args = recipes.parse_args(arg, "configs/scaling.py", {"study": "size", "scale": "cpu", "data": "", "seeds": "3",
                                                          "steps": "", "sizes": "", "archs": "diff+transformer"})
    if not args["data"]:
        raise ConfigError("configs/scaling.py: needs data=<path> (a text file / directory, or prepared shards)")
    study, scale, seeds, names = args["study"], args["scale"], int(args["seeds"]), _archs(args["archs"])
    if study not in ("size", "tokens") or scale not in ("cpu", "paper"):
        raise ConfigError(f"configs/scaling.py: study must be size|tokens and scale cpu|paper, got {study}, {scale}")
    source = recipes.data_source(args["data"])
    name = f"scaling-{study}-{scale}"
    if scale == "paper":
        size = "3B" if study == "tokens" else "1.4B"
        optim, data, train = recipes.paper_recipe(size)
        data = dataclasses.replace(data, source=source, path=args["data"])
        every = 10_000 if study == "tokens" else 2_000
        train = dataclasses.replace(train, steps=int(args["steps"] or (90_000 if study == "tokens" else train.steps)),
                                    eval_every=every, eval_batches=32, checkpoint_every=1000, log_every=50)
        model = recipes.model_config(size, "diff", **recipes.PAPER_SCALE)
    else:
        optim = OptimConfig(lr=2e-3, final_lr=2e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
        data = DataConfig(source=source, path=args["data"], tokenizer="byte", seq_len=128, batch_size=16)
        steps = int(args["steps"] or (1200 if study == "tokens" else 600))
        train = TrainConfig(steps=steps, log_every=20, eval_every=200 if study == "tokens" else steps, eval_batches=8,
                            checkpoint_every=200)
        d_model, layers, h, d = CPU_SIZES["m"]
        model = ModelConfig(arch="diff", vocab_size=recipes.BYTE_VOCAB, d_model=d_model, n_layers=layers, n_heads=h,
                            head_dim=d, dtype="float32")
    base = Config(model=model, data=data, optim=optim, train=train, name=name)
    if study == "tokens":
        return Sweep.build(base, variants(recipes.matched_rows(names, model, model.n_heads, model.head_dim)),
                           seeds=seeds)
    rows = {}
    for size in _chosen(args["sizes"], PAPER_SIZES if scale == "paper" else tuple(CPU_SIZES)):
        if scale == "paper":  # each size its own DIFF model and learning rate
            diff = recipes.model_config(size, "diff")
            shape = (diff.d_model, diff.n_layers, diff.n_heads, diff.head_dim)
            extra = {"optim.lr": recipes.paper_recipe(size)[0].lr}
        else:
            diff, shape, extra = model, CPU_SIZES[size], {}
        d_model, layers, h, d = shape
        for arch, over in recipes.matched_rows(names, diff, h, d).items():
            rows[f"{size}-{arch}"] = {**over, "model.d_model": d_model, "model.n_layers": layers, **extra}
    return Sweep.build(base, variants(rows), seeds=seeds)


def _chosen(sizes: str, known: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(filter(None, sizes.split("+"))) or known
    if unknown := [x for x in chosen if x not in known]:
        raise ConfigError(f"configs/scaling.py: unknown sizes {unknown}; choose from {'+'.join(known)}")
    return chosen

"""The paper's Fig. 3 scaling studies as sweeps: model size (3a) and training tokens (3b), both archs.

    diffjax sweep --config configs/scaling.py:study=size,scale=cpu,data=path/to/corpus.txt,seeds=3
    diffjax sweep --config configs/scaling.py:study=tokens,scale=cpu,data=path/to/corpus.txt,seeds=3
    python experiments/scaling.py --size-sweep runs/sweeps/scaling-size-cpu --token-sweep runs/sweeps/scaling-tokens-cpu

- `study=size,scale=paper`: 830M, 1.4B, 2.8B, 6.8B, 13.1B (Table 10) for DIFF and the Transformer, Appendix E's
  recipe (40k steps × 0.25M tokens at 2048; lr 1.5e-4 up to 2.8B, 7.5e-5 above). Each size × arch is its own group.
- `study=tokens,scale=paper`: the 3B model of Table 9 with its recipe (4M-token batches at 4096), validated every
  10k steps up to 90k (Fig. 3b reads the loss at 10k, 20k, …, 90k steps of one run per arch).
- `scale=cpu`: four sizes spanning > 10× in parameters (d_model 64 → 256, 2 → 4 layers; byte tokenizer), and a
  token study on the middle size validated every 200 steps; seeds (default 3) for error bars.
Arguments: study (size | tokens), scale (cpu | paper), data (path; required), seeds, steps, sizes (a subset of
the study's sizes joined by "+", e.g. sizes=xs+s; default all), archs (registered archs joined by "+", default
diff+transformer, e.g. diff+transformer+gated+dint; each matched in parameters to the DIFF model of every size as
in docs/design.md §2).
"""

import dataclasses

from diffjax import recipes
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.model import archs
from diffjax.sweep import Sweep, variants

# CPU sizes: (d_model, layers, DIFF heads h, head dim d); the Transformer has 2h heads of d (same parameters)
CPU_SIZES = {"xs": (64, 2, 1, 32), "s": (96, 3, 1, 48), "m": (160, 3, 2, 40), "l": (256, 4, 2, 64)}
PAPER_SIZES = ("830M", "1.4B", "2.8B", "6.8B", "13.1B")


def _arch_rows(names: tuple[str, ...], diff: ModelConfig, h: int, d: int) -> dict[str, dict]:
    """Each arch matched in parameters to a DIFF model of h heads of d (`diff`: the base config, for options)."""
    rows = {}
    for name in names:
        heads, head_dim = archs.matched_shape(dataclasses.replace(diff, arch=name), h, d)
        rows[name] = {"model.arch": name, "model.n_heads": heads, "model.head_dim": head_dim}
    return rows


def _archs(arg: str) -> tuple[str, ...]:
    names = tuple(filter(None, arg.split("+")))
    if unknown := [n for n in names if n not in archs.names()]:
        raise ConfigError(f"configs/scaling.py: archs: unknown {unknown}; registered: {'+'.join(archs.names())}")
    if len(set(names)) != len(names) or len(names) < 2:
        raise ConfigError(f"configs/scaling.py: archs: at least two distinct archs joined by '+', got {arg!r}")
    return names


def get_sweep(arg: str = "") -> Sweep:
    args = recipes.parse_args(arg, "configs/scaling.py",
                              {"study": "size", "scale": "cpu", "data": "", "seeds": "3", "steps": "",
                               "sizes": "", "archs": "diff+transformer"})
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
        base_model = recipes.model_config(size, "diff", **recipes.PAPER_SCALE)
        base = Config(model=base_model, data=data, optim=optim, train=train, name=name)
        if study == "tokens":
            return Sweep.build(base, variants(_arch_rows(names, base_model, base_model.n_heads, base_model.head_dim)),
                               seeds=seeds)
        rows = {}
        for s in _chosen(args["sizes"], PAPER_SIZES):
            m = recipes.model_config(s, "diff")
            lr = recipes.paper_recipe(s)[0].lr
            for arch, over in _arch_rows(names, m, m.n_heads, m.head_dim).items():
                rows[f"{s}-{arch}"] = {**over, "model.d_model": m.d_model, "model.n_layers": m.n_layers,
                                       "optim.lr": lr}
        return Sweep.build(base, variants(rows), seeds=seeds)

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
        return Sweep.build(base, variants(_arch_rows(names, model, h, d)), seeds=seeds)
    rows = {}
    for size in _chosen(args["sizes"], tuple(CPU_SIZES)):
        d_model, layers, h, d = CPU_SIZES[size]
        for arch, over in _arch_rows(names, model, h, d).items():
            rows[f"{size}-{arch}"] = {**over, "model.d_model": d_model, "model.n_layers": layers}
    return Sweep.build(base, variants(rows), seeds=seeds)


def _chosen(sizes: str, known: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(filter(None, sizes.split("+"))) or known
    if unknown := [x for x in chosen if x not in known]:
        raise ConfigError(f"configs/scaling.py: unknown sizes {unknown}; choose from {'+'.join(known)}")
    return chosen

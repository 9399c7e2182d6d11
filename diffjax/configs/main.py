"""The main job (`diffjax train` with no --config, `make train`): DIFF vs its parameter-matched Transformer on
synthetic needle retrieval (one needle by default), several seeds per arch as one sweep, sized for a few CPU
minutes.

    diffjax train                                          # this file, default arguments
    diffjax train --config configs/main.py:seeds=5,steps=3000 --workdir runs/main-long

The quickstart's model (~0.5M parameters) on 1 needle at length 128: the largest retrieval setting both archs learn
within the CPU budget (docs/results.md §1.1).
Arguments: seeds (default 3), steps (default 800), needles (default 1), seq_len (default 128), baselines (default
none: any registered archs joined by '+', e.g. gated+sink+dint, parameter-matched to DIFF, as extra variants).
"""

from diffjax import recipes
from diffjax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.sweep import Sweep, SweepOptions, variants


def get_sweep(arg: str = "") -> Sweep:
    args = recipes.parse_args(arg, "configs/main.py", {"seeds": "3", "steps": "800", "needles": "1",
                                                       "seq_len": "128", "baselines": ""})
    steps = int(args["steps"])
    model = ModelConfig(arch="diff", vocab_size=recipes.BYTE_VOCAB, d_model=128, n_layers=2, n_heads=2,
                        head_dim=32, dtype="float32")
    data = DataConfig(tokenizer="byte", seq_len=int(args["seq_len"]), batch_size=16, tasks=("retrieval",),
                      n_needles=int(args["needles"]))
    optim = OptimConfig(lr=3e-3, final_lr=3e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
    train = TrainConfig(steps=steps, log_every=25, eval_every=max(steps // 5, 1), eval_batches=4,
                        checkpoint_every=max(steps // 5, 1), workdir="runs/main")
    base = Config(model=model, data=data, optim=optim, train=train, name="main")
    baselines = recipes.baseline_rows(args["baselines"], "configs/main.py", model)
    archs = variants({"diff": {}, "transformer": {"model.arch": "transformer", "model.n_heads": 4}} | baselines)
    return Sweep.build(base, archs, seeds=int(args["seeds"]), options=SweepOptions(reference="transformer"))

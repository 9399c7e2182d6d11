"""A small CPU sweep: DIFF vs its matched Transformer × 2 learning rates × 3 seeds (12 members in 2 groups).

    diffjax sweep --config configs/sweep_demo.py[:seeds=3,steps=300] [--set train.steps=100] [--workdir DIR]
"""

from diffjax import recipes
from diffjax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.sweep import Sweep, product, variants


def get_sweep(arg: str = "") -> Sweep:
    args = recipes.parse_args(arg, "configs/sweep_demo.py", {"seeds": "3", "steps": "300"})
    model = ModelConfig(arch="diff", vocab_size=512, d_model=128, n_layers=2, n_heads=2, head_dim=32, dtype="float32")
    data = DataConfig(tokenizer="byte", seq_len=128, batch_size=16, tasks=("retrieval",), n_needles=1)
    optim = OptimConfig(lr=3e-3, final_lr=3e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
    train = TrainConfig(steps=int(args["steps"]), log_every=10, eval_every=100, eval_batches=2, checkpoint_every=100)
    base = Config(model=model, data=data, optim=optim, train=train, name="sweep_demo")
    archs = variants({"diff": {}, "transformer": {"model.arch": "transformer", "model.n_heads": 4}})
    return Sweep.build(base, archs, *product({"optim.lr": [1e-3, 3e-3]}), seeds=int(args["seeds"]))

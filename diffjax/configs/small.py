"""CPU-sized models on the synthetic retrieval + MQAR mixture: `configs/small.py:size=small,arch=diff`.

sizes: tiny (~0.2M parameters) and small (~11M); arch: any registered; gate (gated only): headwise | elementwise.
"""

from diffjax import recipes
from diffjax.config import Config, DataConfig, OptimConfig, TrainConfig


def get_config(arg: str = ""):
    size, arch, options = recipes.size_arch_options(arg, "configs/small.py", default_size="small")
    model = recipes.model_config(size, arch, dtype="float32", **options)
    optim = OptimConfig(lr=1e-3, final_lr=1e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
    data = DataConfig(seq_len=256 if size == "tiny" else 512, batch_size=16 if size == "tiny" else 8)
    name = "-".join([size, arch, *options.values()])
    train = TrainConfig(steps=500, eval_every=100, checkpoint_every=100, workdir=f"runs/{name}")
    return Config(model=model, data=data, optim=optim, train=train, name=name)

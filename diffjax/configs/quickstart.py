"""A single quick run: a tiny DIFF Transformer (0.5M parameters) on the synthetic retrieval + MQAR mixture, about 3
minutes on a 2-core CPU; 400 steps are far too few to solve retrieval. The matched baseline is
`--set model.arch=transformer --set model.n_heads=4`."""

from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config(arg: str = "") -> Config:
    if arg:
        raise ConfigError(f"configs/quickstart.py takes no argument, got {arg!r}; use --set to change fields")
    model = ModelConfig(arch="diff", vocab_size=512, d_model=128, n_layers=2, n_heads=2, head_dim=32, dtype="float32")
    data = DataConfig(source="synthetic", tokenizer="byte", seq_len=256, batch_size=16, n_needles=2)
    optim = OptimConfig(lr=3e-3, final_lr=3e-4, warmup_steps=50, b1=0.9, b2=0.98, weight_decay=0.05)
    train = TrainConfig(steps=400, log_every=20, eval_every=100, eval_batches=4, checkpoint_every=100,
                        workdir="runs/quickstart")
    return Config(model=model, data=data, optim=optim, train=train, name="quickstart")

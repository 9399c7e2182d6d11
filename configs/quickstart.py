"""The embedded default run: a tiny DIFF Transformer on the synthetic retrieval + MQAR mixture, on CPU in a few
minutes. `diffjax train` with no --config runs this; `--set model.arch=transformer` gives its baseline."""

from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config(arg: str = "") -> Config:
    if arg:
        raise ConfigError(f"configs/quickstart.py takes no argument, got {arg!r}; use --set to change fields")
    model = ModelConfig(arch="diff", vocab_size=512, d_model=128, n_layers=4, n_heads=2, head_dim=32,
                        dtype="float32")
    data = DataConfig(source="synthetic", tokenizer="byte", seq_len=256, batch_size=32, n_needles=3)
    optim = OptimConfig(lr=2e-3, final_lr=2e-4, warmup_steps=100, b1=0.9, b2=0.98, weight_decay=0.05)
    train = TrainConfig(steps=1500, log_every=25, eval_every=250, eval_batches=4, checkpoint_every=250,
                        workdir="runs/quickstart")
    return Config(model=model, data=data, optim=optim, train=train, name="quickstart")

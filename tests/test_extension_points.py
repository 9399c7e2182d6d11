"""A new architecture and a new evaluation protocol, registered from this module alone, go through the normal
entry points: config validation, training, FLOP counting, attention maps, and `diffjax eval --protocol`."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import checks, cli, flops
from diffjax import config as config_lib
from diffjax import eval as eval_lib
from diffjax.config import ConfigError
from diffjax.eval.attention_maps import attention_maps
from diffjax.kernels import reference
from diffjax.model import archs, param_count
from diffjax.model.attention import attention_op, projections
from diffjax.model.layers import dense, rotary
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics


class SharedKVAttention(nn.Module):
    """A toy arch: multi-query attention (one kv head for all query heads) with a learned output gate."""

    cfg: object

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = projections(cfg, x, q_heads=cfg.n_heads, k_heads=1, v_dim=cfg.head_dim)
        q, k = rotary(q, positions, cfg), rotary(k, positions, cfg)
        self.sow("intermediates", "qk", (q, k))
        out = attention_op(cfg, "attention", q, k, v, segment_ids=segment_ids)
        gate = self.param("gate", nn.initializers.ones, (cfg.n_heads,), jnp.float32)
        out = (out * gate[:, None]).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=jnp.float32)(out)


def _toy_params(cfg) -> int:  # W_Q, W_K, W_V (one kv head), W_O
    return cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.d_model * cfg.head_dim + cfg.n_heads * cfg.head_dim * \
        cfg.d_model


TOY = archs.Arch(name="toy_mqa", layer=SharedKVAttention, op="attention",
                 attention_flops=lambda cfg, n, causal, backward: 1.0,
                 attention_map=lambda cfg, sown, mask: reference.attention_probs(*sown["qk"], mask))


@pytest.fixture
def toy_arch(monkeypatch):
    monkeypatch.setitem(archs._REGISTRY, TOY.name, TOY)  # registered for this test only
    return TOY


MICRO = ["model.arch=toy_mqa", "model.d_model=32", "model.n_heads=2", "model.head_dim=16", "model.n_layers=2",
         "data.seq_len=64", "data.batch_size=8", "data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6",
         "train.log_every=1", "train.eval_every=5", "train.eval_batches=1", "optim.warmup_steps=2", "train.steps=5"]


def test_a_toy_arch_trains_and_is_counted_through_the_normal_entry_points(toy_arch, tmp_path, rng):
    with pytest.raises(ConfigError, match="unknown arch 'toy_mqb'"):
        checks.load("configs/small.py:size=tiny,arch=diff", MICRO + ["model.arch=toy_mqb"])
    cfg = checks.load("configs/small.py:size=tiny,arch=diff", MICRO)
    m = cfg.model
    # parameters: embeddings and head, per layer the toy attention + its gate, 2 norms, SwiGLU; final norm
    per_layer = _toy_params(m) + m.n_heads + 2 * m.d_model + 3 * m.d_model * m.resolved_ffn_dim
    assert param_count(m)["params"] == 2 * m.vocab_size * m.d_model + m.n_layers * per_layer + m.d_model
    assert flops.attention_params(m) == _toy_params(m)  # the matmul weights, from its parameters (not its gate)
    assert flops.train_flops_per_token(m, 64) == 6.0 * flops.matmul_params(m) + m.n_layers * 1.0 / 64

    result = train(cfg, tmp_path, progress=False)
    assert result.step == 5 and np.isfinite(result.val["loss"])
    assert [r["step"] for r in read_metrics(tmp_path) if r["split"] == "train"] == [2, 3, 4, 5]
    tokens = jnp.asarray(rng.integers(0, 300, (2, 12)))
    maps = attention_maps(m, result.state.params, tokens)
    assert maps.shape == (2, 2, 2, 12, 12)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)


@pytest.mark.slow  # end to end through the CLI
def test_a_toy_protocol_runs_from_the_cli(monkeypatch, tmp_path, capsys):
    def count_params(cfg, params, *, scale: float = 1.0) -> dict:
        return {"n": scale * sum(x.size for x in jax.tree.leaves(params))}

    monkeypatch.setitem(eval_lib._REGISTRY, "toy_count", eval_lib.Protocol("toy_count", count_params))
    cfg = config_lib.load("configs/small.py:size=tiny,arch=diff", MICRO[1:] + ["model.n_heads=1"])
    train(cfg, tmp_path, progress=False)

    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "toy_count", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["toy_count"]["n"] == param_count(cfg.model)["params"]
    assert json.loads((tmp_path / "eval" / "toy_count.json").read_text()) == {"step": 5, "overrides": [],
                                                                              **printed["toy_count"]}
    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "all", "--json"]) == 0  # all that apply
    assert {"validation", "toy_count"} <= set(json.loads(capsys.readouterr().out))
    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "nope"]) == 2
    assert "unknown evaluation protocol 'nope'" in capsys.readouterr().err

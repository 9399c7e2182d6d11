import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax.config import ConfigError, ModelConfig
from diffjax.model import DecoderLM, decode_step, init_cache, lambda_init_schedule, param_count


def test_lambda_init_schedule():
    np.testing.assert_allclose(lambda_init_schedule(1), 0.2, rtol=1e-6)
    np.testing.assert_allclose(lambda_init_schedule(2), 0.8 - 0.6 * np.exp(-0.3), rtol=1e-6)
    assert abs(float(lambda_init_schedule(100)) - 0.8) < 1e-6


@pytest.mark.parametrize("arch,heads", [("diff", 2), ("transformer", 4), ("diff_v2", 2)])
@pytest.mark.parametrize("scan", [False, True])
def test_kv_cache_decode_matches_full_forward(arch, heads, scan):
    cfg = ModelConfig(arch=arch, vocab_size=300, d_model=64, n_layers=2, n_heads=heads, head_dim=16,
                      dtype="float32", scan_layers=scan)
    cfg.validate()
    tok = jax.random.randint(jax.random.key(np.random.randint(1 << 30)), (2, 12), 0, 300)
    params = DecoderLM(cfg).init(jax.random.key(0), tok)["params"]
    full = DecoderLM(cfg).apply({"params": params}, tok)
    cache = init_cache(cfg, 2, 16)
    out, cache = decode_step(cfg, params, cache, tok[:, :7])
    outs = [out]
    for i in range(7, 12):
        out, cache = decode_step(cfg, params, cache, tok[:, i:i + 1])
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-4)


def test_diff_and_transformer_parity():
    diff = ModelConfig(arch="diff", vocab_size=300, d_model=64, n_layers=2, n_heads=2, head_dim=16)
    base = ModelConfig(arch="transformer", vocab_size=300, d_model=64, n_layers=2, n_heads=4, head_dim=16)
    # difference: per layer 4 λ vectors of d and one head-norm weight of 2d
    assert param_count(diff)["params"] - param_count(base)["params"] == 2 * (4 * 16 + 32)


def test_config_errors():
    with pytest.raises(ConfigError, match="d_model"):
        ModelConfig(arch="diff", d_model=100, n_heads=2, head_dim=16).validate()
    with pytest.raises(ConfigError, match="lambda_init"):
        ModelConfig(arch="diff", d_model=64, n_heads=2, head_dim=16, lambda_init=1.5).validate()

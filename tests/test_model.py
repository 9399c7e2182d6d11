import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diffjax import checks, cli, recipes
from diffjax import config as config_lib
from diffjax.config import ConfigError, ModelConfig
from diffjax.model import (
    DecoderLM,
    archs,
    decode_step,
    init_cache,
    lambda_init_schedule,
    lambda_inits,
    layer_lambdas,
    param_count,
)


def test_lambda_init_schedule():
    np.testing.assert_allclose(lambda_init_schedule(1), 0.2, rtol=1e-6)
    np.testing.assert_allclose(lambda_init_schedule(2), 0.8 - 0.6 * np.exp(-0.3), rtol=1e-6)
    assert abs(float(lambda_init_schedule(100)) - 0.8) < 1e-6


@pytest.mark.parametrize("scan", [False, True])
def test_decoding_past_the_cache_is_refused_not_clamped(scan, rng):
    cfg = ModelConfig(arch="diff", vocab_size=300, d_model=64, n_layers=2, n_heads=2, head_dim=16,
                      dtype="float32", scan_layers=scan)
    tok = jax.random.randint(jax.random.key(int(rng.integers(1 << 30))), (2, 9), 0, 300)
    params = jax.jit(DecoderLM(cfg).init)(jax.random.key(0), tok)["params"]
    full = jax.jit(DecoderLM(cfg).apply)({"params": params}, tok[:, :8])
    jitted = jax.jit(functools.partial(decode_step, cfg))
    out, cache = jitted(params, init_cache(cfg, 2, 8), tok[:, :6])
    last, full_cache = jitted(params, cache, tok[:, 6:8])  # exactly fills the 8 positions
    np.testing.assert_allclose(last, full[:, 6:8], atol=1e-4)
    # eager calls know the fill: refused before any computation
    with pytest.raises(ValueError, match="holds 8 positions, 8 are filled and 1 more do not fit"):
        decode_step(cfg, params, full_cache, tok[:, 8:9])
    with pytest.raises(ValueError, match="holds 8 positions, 6 are filled and 3 more"):
        decode_step(cfg, params, cache, tok[:, 6:9])
    assert np.isnan(jitted(params, full_cache, tok[:, 8:9])[0]).all()


def test_diff_and_transformer_parity():
    diff = ModelConfig(arch="diff", vocab_size=300, d_model=64, n_layers=2, n_heads=2, head_dim=16)
    base = ModelConfig(arch="transformer", vocab_size=300, d_model=64, n_layers=2, n_heads=4, head_dim=16)
    # difference: per layer 4 λ vectors of d and one head-norm weight of 2d
    assert param_count(diff)["params"] - param_count(base)["params"] == 2 * (4 * 16 + 32)


def test_config_errors():
    checks.check_model(ModelConfig(arch="diff", d_model=100, n_heads=2, head_dim=16))  # D ≠ 2hd is allowed (#22)
    with pytest.raises(ConfigError, match="model.n_kv_heads: 3 kv heads do not divide 2 heads"):
        checks.check_model(ModelConfig(arch="diff", d_model=64, n_heads=2, n_kv_heads=3, head_dim=16))
    with pytest.raises(ConfigError, match="model.head_dim: rotary embeddings need an even head_dim"):
        checks.check_model(ModelConfig(arch="diff", d_model=64, n_heads=2, head_dim=15))
    with pytest.raises(ConfigError, match="model.arch: unknown arch 'dif'"):
        checks.check_model(ModelConfig(arch="dif", d_model=64, n_heads=2, head_dim=16))
    with pytest.raises(ConfigError, match="lambda_init"):
        checks.check_model(ModelConfig(arch="diff", d_model=64, n_heads=2, head_dim=16, lambda_init=1.5))


def _tiny(arch, **kw):  # the tiny CPU size, parameter-matched to DIFF's 2 heads of 16
    return checks.check_model(recipes.model_config("tiny", arch, vocab_size=300, dtype="float32", **kw))


@pytest.mark.parametrize("arch", archs.names())
def test_bfloat16_compute_close_to_float32(arch, rng):
    """bf16 compute stays near float32, in units of the logits' std: the RMS error ~1.7 u (u = 2⁻⁸, bf16's unit
    roundoff; 0.0063 ± 0.0004 for DIFF and DINT, at most 0.0086 over 3,000 token draws), bounded at 0.012 ≈ 3 u; the
    worst single logit, a heavy-tailed maximum (0.029 ± 0.003, up to 0.049 over the same draws), bounded at 0.1, which
    a masking or position error far exceeds. Rounding of this size hides a bf16 A1 − λA2 here (the maps do not
    cancel at init); tests/test_kernels.py's near-cancelling inputs check that subtraction."""
    cfg = _tiny(arch)
    tokens = jax.random.randint(jax.random.key(int(rng.integers(1 << 30))), (2, 16), 0, 300)
    params = jax.jit(DecoderLM(cfg).init)(jax.random.key(2), tokens)["params"]
    f32 = jax.jit(DecoderLM(cfg).apply)({"params": params}, tokens)
    bf16 = jax.jit(DecoderLM(dataclasses.replace(cfg, dtype="bfloat16")).apply)({"params": params}, tokens)
    assert bf16.dtype == jnp.float32  # logits come back in float32
    err = (np.asarray(bf16) - np.asarray(f32)) / np.asarray(f32).std()
    rms, worst = np.sqrt(np.mean(err ** 2)), np.abs(err).max()
    assert rms < 0.012 and worst < 0.1, (rms, worst)
    # every parameter stays float32 whatever the compute dtype
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.meta.unbox(params)))


def test_lambda_at_init_is_close_to_lambda_init(rng):
    cfg = dataclasses.replace(_tiny("diff"), n_layers=12, d_model=256, n_heads=2, head_dim=64)
    key = jax.random.key(int(rng.integers(1 << 30)))
    params = jax.jit(DecoderLM(cfg).init)(key, jnp.zeros((1, 4), jnp.int32))["params"]
    lam, inits = np.asarray(layer_lambdas(params, cfg)), np.asarray(lambda_inits(cfg))
    np.testing.assert_allclose(inits[:2], [0.2, 0.8 - 0.6 * np.exp(-0.3)], rtol=1e-6)
    # λ − λ_init = exp(q1·k1) − exp(q2·k2) with q, k ~ N(0, 0.1²)^64: std 0.114 a layer, 0.033 the mean of 12;
    # over 2·10⁵ simulated inits the largest |λ − λ_init| was 0.62 and the largest |mean| 0.14 (bounds ≥ 6σ)
    assert np.abs(lam - inits).max() < 0.8
    assert abs(np.mean(lam - inits)) < 0.2
    vecs = np.concatenate([np.asarray(nn.meta.unbox(params[f"layer_{i}"]["attn"][n]))
                           for i in range(12) for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")])
    assert 0.09 < vecs.std() < 0.11 and abs(vecs.mean()) < 0.01


PAPER_PARAMS = {"830M": 830e6, "1.4B": 1.4e9, "2.8B": 2.8e9, "6.8B": 6.8e9, "13.1B": 13.1e9}


@pytest.mark.parametrize("size", list(PAPER_PARAMS) + ["3B"])
def test_paper_sizes_and_pair_parity(size):
    diff = config_lib.load(f"configs/paper.py:size={size},arch=diff")
    base = config_lib.load(f"configs/paper.py:size={size},arch=transformer")
    d, b = param_count(diff.model), param_count(base.model)
    layers, head_dim = diff.model.n_layers, diff.model.head_dim
    # equal except, per layer, the four λ vectors (d each) and the headwise-norm weight (2d)
    assert d["params"] - b["params"] == layers * (4 * head_dim + 2 * head_dim)
    if size in PAPER_PARAMS:  # Table 10 names, counting one embedding matrix
        assert abs(d["params_paper"] / PAPER_PARAMS[size] - 1) < 0.03, d
    else:  # Table 9's exact 3B shape (FFN 8192) counts 3.48B; the paper's "3B" is a loose name
        assert 3.4e9 < d["params_paper"] < 3.6e9


def test_summary_json_command(capsys):
    cli.main(["summary", "--config", "configs/small.py:size=tiny,arch=diff", "--set", "model.n_layers=3", "--json"])
    info = json.loads(capsys.readouterr().out)
    cfg = dataclasses.replace(config_lib.load("configs/small.py:size=tiny,arch=diff").model, n_layers=3)
    # independent count: embeddings + per layer (4 projections, 4 λ vectors, 3 norms, SwiGLU) + final norm
    dm, f, d = cfg.d_model, cfg.resolved_ffn_dim, cfg.head_dim
    per_layer = 4 * dm * dm + 4 * d + 2 * d + 2 * dm + 3 * dm * f
    assert info["params"] == 2 * cfg.vocab_size * dm + 3 * per_layer + dm
    np.testing.assert_allclose(info["lambda_init"], [0.2, 0.8 - 0.6 * np.exp(-0.3), 0.8 - 0.6 * np.exp(-0.6)],
                               rtol=1e-6)
    assert info["flops_per_token"] > 6 * info["params"]  # 6N plus attention


@pytest.mark.parametrize("override,field", [
    ("model.n_kv_heads=3", "n_kv_heads"),
    ("model.arch=gpt", "arch"),
    ("model.attention_impl=nope", "attention_impl"),

    ("model.n_layers=two", "n_layers"),
    ("model.lambda_init=0", "lambda_init"),
    ("model.bogus=1", "bogus"),
    ("data.tokenizer=cl100k_base", r"model.vocab_size: 512 ids cannot embed the cl100k_base tokenizer's ids .* "
                                   r"up to 100277\); set model.vocab_size=100288"),
    ("optimizer.lr=1", "optimizer"),
])
def test_bad_overrides_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        checks.load("configs/small.py:size=tiny,arch=diff", [override])


def test_impl_without_the_archs_op_is_rejected():
    for arch in ("diff", "transformer", "dint"):  # the fused kernels: two maps for DIFF, one for the standard op
        checks.load(f"configs/small.py:size=tiny,arch={arch}", ["model.attention_impl=pallas"])
    with pytest.raises(ConfigError, match="attention_impl: impl 'tpu_flash' has no diff_attention kernel"):
        checks.load("configs/small.py:size=tiny,arch=diff", ["model.attention_impl=tpu_flash"])


def test_v2_pairs_must_not_cross_gqa_groups():
    # 6 query heads over 2 kv heads: groups {0,1,2} {3,4,5} would split the pair (2, 3)
    with pytest.raises(ConfigError, match="cross GQA groups"):
        checks.check_model(ModelConfig(arch="diff_v2", d_model=96, n_heads=3, head_dim=16, n_kv_heads=2))
    checks.check_model(ModelConfig(arch="diff_v2", d_model=96, n_heads=4, head_dim=16, n_kv_heads=2))

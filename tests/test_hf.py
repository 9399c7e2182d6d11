"""Hugging Face checkpoints in and out: golden DiffLlama / Llama / Qwen2 / Qwen3 / Mistral fixtures (made by
tests/fixtures/hf/make_fixtures.py) load with their logits, Llamas with llama3 / linear RoPE scaling as they ship
(bf16, tied, GQA, θ 500,000) included; exports reload equal (a golden
checkpoint re-exports bit for bit as its own class), and load in transformers equal where torch is installed; bad
directories and settings diffjax does not compute (MoE, sliding windows, …) are refused by name."""

import dataclasses
import functools
import importlib.util
import json
import re
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from diffjax import config as config_lib
from diffjax.config import ConfigError, ModelConfig
from diffjax.hf import load_pretrained, mapping, save_pretrained
from diffjax.hf.run import import_run
from diffjax.model import DecoderLM, decode_step, init_cache
from diffjax.model.layers import rope_frequencies

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# The golden fixtures of one class each: its diffjax arch and the attention options it carries.
GOLDEN = {"diffllama": ("diff", {}), "llama": ("transformer", {}),
          "qwen2": ("transformer", {"hf_class": "Qwen2ForCausalLM", "qkv_bias": True, "tie_embeddings": True}),
          "qwen3": ("transformer", {"hf_class": "Qwen3ForCausalLM", "qk_norm": True, "head_dim": 16}),
          "mistral": ("transformer", {"hf_class": "MistralForCausalLM", "qkv_bias": False, "qk_norm": False})}
TINY_DIFF = ModelConfig(arch="diff", vocab_size=96, d_model=32, n_layers=2, n_heads=2, head_dim=8, n_kv_heads=1,
                        ffn_dim=48, rope_theta=500.0, dtype="float32")


def logits(cfg, params, ids):
    return np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, jnp.asarray(ids)))


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_hf_checkpoint_loads_with_equal_logits(name):
    cfg, params = load_pretrained(FIXTURES / name)
    arch, options = GOLDEN[name]
    assert cfg.arch == arch and cfg.kv_heads < cfg.n_heads
    assert {k: getattr(cfg, k) for k in options} == options
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    err = rel_err(logits(cfg, params, golden["ids"]), golden["logits"])
    print(f"{name}: max relative logit error vs golden {err:.2e}")
    assert err <= 1e-4


def trained_diff(cfg=TINY_DIFF, seed=0):
    """Initialised params perturbed everywhere, head-norm scale and λ vectors included (as training leaves them)."""
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])
    return _perturbed(params, jax.random.key(seed + 1))


@jax.jit
def _perturbed(params, key):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize("scan, shard", [(False, None), (True, 20_000)])
def test_export_reloads_equal(tmp_path, scan, shard):
    cfg = dataclasses.replace(TINY_DIFF, scan_layers=scan)
    params = trained_diff(cfg)
    save_pretrained(cfg, params, tmp_path, **({"max_shard_bytes": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    if shard:  # the index's metadata as transformers writes it: the tensors' elements and bytes
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        tensors = [t for f in files for t in load_file(str(tmp_path / f)).values()]
        assert len(files) > 1 and not (tmp_path / "model.safetensors").exists()
        assert index["metadata"] == {"total_parameters": sum(t.size for t in tensors),
                                     "total_size": sum(t.nbytes for t in tensors)}
    cfg2, params2 = load_pretrained(tmp_path)
    ids = np.arange(20).reshape(2, 10) % cfg.vocab_size
    # the reloaded model has unit head-norm scales: the trained ones were folded into W_O
    assert rel_err(logits(cfg2, params2, ids), logits(cfg, params, ids)) <= 1e-5


def tiny(arch: str, tie: bool = False) -> ModelConfig:
    cfg = TINY_DIFF if arch == "diff" else dataclasses.replace(TINY_DIFF, arch="transformer", n_heads=4, n_kv_heads=2)
    return dataclasses.replace(cfg, tie_embeddings=tie)


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_tied_embeddings_round_trip(tmp_path, arch):
    cfg = tiny(arch, tie=True)
    params = trained_diff(cfg)
    assert "lm_head" not in params
    save_pretrained(cfg, params, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))  # HF omits a tied head
    cfg2, params2 = load_pretrained(tmp_path)
    assert cfg2.tie_embeddings and "lm_head" not in params2
    ids = np.arange(20).reshape(2, 10) * 3 % cfg.vocab_size
    assert rel_err(logits(cfg2, params2, ids), logits(cfg, params, ids)) <= 1e-5


@pytest.mark.parametrize("name", ["diffllama", "qwen2", "qwen3", "mistral"])
def test_golden_reexport_is_the_same_checkpoint(tmp_path, name):
    """Every tensor bit for bit, as the same class with the fields that say what it computes; it reloads as the
    same model."""
    cfg, params = load_pretrained(FIXTURES / name)
    save_pretrained(cfg, params, tmp_path)
    ours, theirs = load_file(str(tmp_path / "model.safetensors")), load_file(str(FIXTURES / name /
                                                                                  "model.safetensors"))
    assert set(ours) == set(theirs)
    for tensor in theirs:
        np.testing.assert_array_equal(ours[tensor], theirs[tensor].astype(np.float32), err_msg=tensor)
    config, original = (json.loads((path / "config.json").read_text()) for path in (tmp_path, FIXTURES / name))
    fields = ("architectures", "model_type", "attention_bias", "sliding_window", "use_sliding_window", "head_dim",
              "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "rope_parameters")
    assert {k: config.get(k) for k in fields} == {k: original.get(k) for k in fields}
    assert load_pretrained(tmp_path)[0] == cfg


def copy_fixture(tmp_path, name="diffllama") -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeForCausalLM"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"intermediate_size": 64}, "mismatched config.json"),
    ({"num_hidden_layers": 3}, "model.layers.2"),
])
def test_bad_checkpoints_are_refused_by_name(tmp_path, change, message):
    path = copy_fixture(tmp_path)
    edit_config(path, **change)
    with pytest.raises(ConfigError, match=message):
        load_pretrained(path)


def test_missing_config_and_weights_are_refused(tmp_path):
    path = copy_fixture(tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_pretrained(path)
    path = copy_fixture(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_pretrained(path)


def test_unexportable_models_are_refused(tmp_path):
    for change, message in (({"arch": "diff_v2", "n_kv_heads": None}, "diff_v2"),
                            ({"headwise_norm": False}, "headwise_norm"), ({"lambda_init": 0.5}, "lambda_init"),
                            ({"qk_norm": True}, "^model.qk_norm: DiffLlamaForCausalLM has no qk_norm"),
                            ({"arch": "transformer", "qkv_bias": True},
                             "^model.qkv_bias: .* set model.hf_class=Qwen2ForCausalLM$"),
                            ({"arch": "transformer", "qkv_bias": True, "qk_norm": True}, "no class diffjax writes"),
                            ({"arch": "transformer", "hf_class": "Qwen3ForCausalLM"}, "^model.qk_norm: Qwen3"),
                            ({"hf_class": "Qwen2ForCausalLM"}, "^model.hf_class: 'Qwen2ForCausalLM' is not a class")):
        cfg = dataclasses.replace(TINY_DIFF, **change)
        with pytest.raises(ConfigError, match=message):
            save_pretrained(cfg, {}, tmp_path)


LIVE = pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                          reason="live comparison needs torch and transformers")


def transformers_logits(path, ids) -> np.ndarray:
    """float32 logits of the HF directory `path` loaded by `transformers.AutoModelForCausalLM`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()


@LIVE
@pytest.mark.parametrize("arch, tie", [("diff", False), ("transformer", False), ("diff", True)])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, arch, tie):
    cfg = tiny(arch, tie)
    params = trained_diff(cfg)
    save_pretrained(cfg, params, tmp_path)
    ids = np.arange(24).reshape(2, 12) * 7 % cfg.vocab_size
    err = rel_err(logits(cfg, params, ids), transformers_logits(tmp_path, ids))
    print(f"{arch} (tied {tie}): max relative logit error vs transformers {err:.2e}")
    assert err <= 1e-4


@LIVE
@pytest.mark.parametrize("name", ["diffllama", "llama"])
def test_golden_fixture_still_matches_transformers(name):
    """The committed golden logits are what the installed transformers computes for the fixture."""
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    err = rel_err(transformers_logits(FIXTURES / name, golden["ids"]), golden["logits"])
    print(f"{name}: max relative logit error, installed transformers vs golden {err:.2e}")
    assert err <= 1e-5


def test_token_ids_inside_the_vocabulary_only():
    """A model smaller than its tokenizer (synthetic tasks alone) exports no id past its embedding table, which
    transformers would refuse as a pad id; a byte model of 258+ rows gets EOS (= BOS) 256 and pad 257."""
    assert mapping.token_ids("byte", 256) == {}
    assert mapping.token_ids("byte", 257) == {"bos_token_id": 256, "eos_token_id": 256}
    assert mapping.token_ids("byte", 512) == {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257}


# RoPE scaling: checkpoints as Llama 3.x and linearly-scaled Llamas ship them.
SCALED = {"llama3": dict(rope_scaling="llama3", rope_theta=500_000.0, rope_factor=8.0, rope_low_freq_factor=1.0,
                         rope_high_freq_factor=4.0, rope_original_max_positions=48, tie_embeddings=True,
                         dtype="bfloat16"),
          "llama_linear": dict(rope_scaling="linear", rope_theta=10_000.0, rope_factor=4.0, tie_embeddings=False,
                               dtype="float32")}


def load_float32(path):
    """The checkpoint's config and params, computing in float32 (a bf16 checkpoint computes in bf16 by default)."""
    cfg, params = load_pretrained(path)
    return dataclasses.replace(cfg, dtype="float32"), params


@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_rope_checkpoint_loads_with_equal_logits(name):
    """A llama3-scaled Llama (θ 500,000, tied embeddings, GQA, bf16 safetensors) and a linear-scaled one: their
    golden float32 logits, on ids past the original context, within 1e-5; the same weights without the scaling
    are far off (the fixture exercises it)."""
    cfg, params = load_pretrained(FIXTURES / name)
    assert {k: getattr(cfg, k) for k in SCALED[name]} == SCALED[name] and cfg.kv_heads < cfg.n_heads
    cfg = dataclasses.replace(cfg, dtype="float32")
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    assert golden["ids"].shape[1] > (cfg.rope_original_max_positions or 0)
    err = rel_err(logits(cfg, params, golden["ids"]), golden["logits"])
    print(f"{name}: max relative logit error vs golden {err:.2e}")
    assert err <= 1e-5
    unscaled = dataclasses.replace(cfg, rope_scaling="none", rope_factor=None, rope_low_freq_factor=None,
                                   rope_high_freq_factor=None, rope_original_max_positions=None)
    assert rel_err(logits(unscaled, params, golden["ids"]), golden["logits"]) > 1e-2


def test_llama3_fixture_covers_every_band():
    """The llama3 fixture's frequencies: some kept, some blended (strictly between), the rest divided by the
    factor — so a step in place of the blend, or a wrong factor, changes its logits."""
    cfg, _ = load_pretrained(FIXTURES / "llama3")
    d = cfg.head_dim
    ratio = np.asarray(rope_frequencies(cfg, d)) * cfg.rope_theta ** (np.arange(0, d, 2) / d)  # scaled / unscaled
    kept, divided = np.isclose(ratio, 1, rtol=1e-6), np.isclose(ratio, 1 / cfg.rope_factor, rtol=1e-6)
    assert kept.sum() >= 1 and divided.sum() >= 1 and (~kept & ~divided).sum() >= 2
    assert np.all((ratio > 1 / cfg.rope_factor) & (ratio < 1) | kept | divided)


def test_decoding_with_scaled_rope_matches_golden():
    """The KV cache rotates keys with the same scaled frequencies: a prefill then one token at a time gives the
    golden logits of the whole sequence."""
    cfg, params = load_float32(FIXTURES / "llama3")
    golden = load_file(str(FIXTURES / "llama3" / "golden.safetensors"))
    ids, t = jnp.asarray(golden["ids"]), golden["ids"].shape[1]
    step = jax.jit(functools.partial(decode_step, cfg))
    out, cache = step(params, init_cache(cfg, ids.shape[0], t), ids[:, :40])
    outs = [out]
    for i in range(40, t):
        out, cache = step(params, cache, ids[:, i:i + 1])
        outs.append(out)
    assert rel_err(np.concatenate(outs, axis=1), golden["logits"]) <= 1e-5


def v4_spelling(config: dict) -> dict:
    """transformers v4's spelling of a v5 config.json: `rope_scaling` (with `type`) and a top-level rope_theta."""
    rope = dict(config.pop("rope_parameters"))
    return config | {"rope_theta": rope.pop("rope_theta"), "rope_scaling": {"type": rope.pop("rope_type"), **rope}}


def no_original_context(config: dict) -> dict:
    """The llama3 dict without original_max_position_embeddings: transformers takes max_position_embeddings."""
    rope = dict(config["rope_parameters"])
    return config | {"rope_parameters": rope, "max_position_embeddings": rope.pop("original_max_position_embeddings")}


@pytest.mark.parametrize("spelling", [v4_spelling, no_original_context])
def test_other_spellings_of_llama3_load_the_same_model(tmp_path, spelling):
    path = copy_fixture(tmp_path, "llama3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(spelling(config)))
    assert load_pretrained(path)[0] == load_pretrained(FIXTURES / "llama3")[0]


@pytest.mark.parametrize("name, assignment, message", [
    ("qwen2", "model.qkv_bias=false", "model.qkv_bias: True in the checkpoint, False now (it shapes the saved "
                                      "parameters)"),
    ("qwen3", "model.qk_norm=false", "model.qk_norm: True in the checkpoint, False now (it shapes the saved "
                                     "parameters)"),
    ("llama3", "model.arch=dint", "model.arch: 'transformer' in the checkpoint, 'dint' now (another arch reads the "
                                  "same arrays as other weights: diff's and dint's have the same shapes)")])
def test_import_refuses_what_a_resume_refuses(tmp_path, name, assignment, message):
    """`hf import --set` is held to a resume's rule (`run_config.fixed_changes`): qkv_bias and qk_norm, in no list,
    by the parameters' shapes; the arch by the list."""
    with pytest.raises(ConfigError, match=f"^--set {re.escape(message)}$"):
        import_run(FIXTURES / name, tmp_path / "run", [assignment])


def llama3_cfg(**changes) -> ModelConfig:
    return dataclasses.replace(tiny("transformer"), **{k: v for k, v in SCALED["llama3"].items() if k != "dtype"},
                               dtype="float32", **changes)


SCALED_EXPORTS = pytest.mark.parametrize(
    "cfg", [llama3_cfg(), llama3_cfg(arch="diff", n_heads=2, n_kv_heads=1),
            dataclasses.replace(tiny("diff"), rope_scaling="linear", rope_factor=2.5)],
    ids=["llama3", "diff-llama3", "diff-linear"])


@SCALED_EXPORTS
def test_scaled_rope_export_round_trips(tmp_path, cfg):
    params = trained_diff(cfg)
    save_pretrained(cfg, params, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == cfg.rope_scaling
    cfg2, params2 = load_pretrained(tmp_path)
    assert cfg2 == cfg
    ids = np.arange(40).reshape(2, 20) * 5 % cfg.vocab_size
    assert rel_err(logits(cfg2, params2, ids), logits(cfg, params, ids)) <= 1e-5


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, 'rope_type="yarn"'),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 'rope_scaling.rope_type="dynamic"'),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0}},
     "'low_freq_factor'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "four"}}, "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}}, "model.rope_factor: must be positive"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 64}}, "model.rope_high_freq_factor"),
    ({"head_dim": 16}, "mismatched config.json"),
])
def test_unsupported_llama_settings_are_refused_by_name(tmp_path, change, message):
    path = copy_fixture(tmp_path, "llama")
    edit_config(path, **change)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_pretrained(path)
    assert "\n" not in str(e.value)


def test_rope_scaling_settings_round_trip_and_are_validated():
    """model.rope_* round-trip through config.json and `--set`; a scaling's parameters are set exactly when it
    takes them; each bad value is one line naming its field."""
    cfg = config_lib.Config()
    for assignment in ("model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
                       "model.rope_high_freq_factor=4", "model.rope_original_max_positions=8192",
                       "model.rope_theta=500000"):
        cfg = config_lib.override(cfg, assignment)
    cfg.validate()
    assert config_lib.from_dict(json.loads(cfg.to_json())) == cfg and cfg.model.rope_factor == 8.0
    assert config_lib.Config().model.rope_scaling == "none"  # default runs are unchanged
    for changes, field in (({"rope_scaling": "yarn"}, "model.rope_scaling"),
                           ({"rope_scaling": "linear"}, "model.rope_factor"),
                           ({"rope_factor": 2.0}, "model.rope_factor"),
                           ({"rope_scaling": "linear", "rope_factor": 2.0, "rope_low_freq_factor": 1.0},
                            "model.rope_low_freq_factor"),
                           ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
                             "rope_high_freq_factor": 4.0}, "model.rope_original_max_positions"),
                           ({"rope_scaling": "linear", "rope_factor": 0.0}, "model.rope_factor"),
                           ({"rope_theta": -1.0}, "model.rope_theta")):
        with pytest.raises(ConfigError, match=f"^{re.escape(field)}: ") as e:
            dataclasses.replace(ModelConfig(), **changes).validate()
        assert "\n" not in str(e.value)


@LIVE
def test_rope_frequencies_match_transformers(rng):
    """diffjax's inverse frequencies are transformers' (`ROPE_INIT_FUNCTIONS`) for random linear and llama3
    settings, to float32 rounding: the same operations in the same order, but torch's and XLA's pow may differ in
    the last bit, and XLA divides by a constant as a product with its reciprocal (worst seen: 1.1e-6 relative in
    400 random llama3 settings, the smooth band's blend amplifying a last-bit difference)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for _ in range(6):
        d, theta, factor = int(rng.choice([8, 32, 64, 128])), float(10 ** rng.uniform(3, 6)), float(rng.uniform(1, 16))
        low = float(rng.uniform(0.5, 2))
        high, context = low * float(rng.uniform(1.5, 8)), int(rng.integers(16, 4096))
        for rope in ({"rope_type": "linear", "factor": factor},
                     {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                      "original_max_position_embeddings": context}):
            hf = LlamaConfig(hidden_size=d, num_attention_heads=1, head_dim=d, max_position_embeddings=2 * context,
                             rope_parameters={"rope_theta": theta, **rope})
            cfg = mapping.model_config(hf.to_dict() | {"architectures": [mapping.LLAMA_CLASS]})
            theirs = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)[0].numpy()
            np.testing.assert_allclose(np.asarray(rope_frequencies(cfg, d)), theirs, rtol=4e-6, err_msg=str(rope))


def top_level_original_context(config: dict) -> dict:
    """A top-level original_max_position_embeddings (as Phi-3 writes it) wins over the rope dict's."""
    return config | {"original_max_position_embeddings": 24}


@LIVE
@pytest.mark.parametrize("spelling", [v4_spelling, no_original_context, top_level_original_context])
def test_llama3_spellings_match_transformers(tmp_path, spelling):
    """Each spelling of a llama3 config loads to the logits transformers computes for it."""
    path = copy_fixture(tmp_path, "llama3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(spelling(config)))
    cfg, params = load_float32(path)
    ids = load_file(str(FIXTURES / "llama3" / "golden.safetensors"))["ids"]
    assert rel_err(logits(cfg, params, ids), transformers_logits(path, ids)) <= 1e-5


@LIVE
@SCALED_EXPORTS
def test_scaled_rope_export_loads_in_transformers_with_equal_logits(tmp_path, cfg):
    params = trained_diff(cfg)
    save_pretrained(cfg, params, tmp_path)
    ids = np.arange(120).reshape(2, 60) * 7 % cfg.vocab_size
    assert rel_err(logits(cfg, params, ids), transformers_logits(tmp_path, ids)) <= 1e-5


@LIVE
@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_golden_fixture_still_matches_transformers(name):
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    assert rel_err(transformers_logits(FIXTURES / name, golden["ids"]), golden["logits"]) <= 1e-5


# Qwen2, Qwen3 and Mistral: what diffjax does not compute is refused by name, what it does loads as it ships.
FAMILY_REFUSALS = [
    ("qwen2", {"architectures": ["Qwen2MoeForCausalLM"]}, "architectures ['Qwen2MoeForCausalLM'] — diffjax loads "
     "only DiffLlamaForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ("qwen3", {"architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3MoeForCausalLM"),
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),  # v0.1
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
     "sliding_window=16 is not supported (layers [1] slide"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 2},
     "sliding_window=16"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, 'layer_types ["chunked_attention"]'),
    ("qwen3", {"attention_bias": True}, "attention_bias=true"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, 'rope_type="yarn"'),
    ("mistral", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
]


@pytest.mark.parametrize("name, change, message", FAMILY_REFUSALS)
def test_unsupported_family_settings_are_refused_by_name(tmp_path, name, change, message):
    path = copy_fixture(tmp_path, name)
    edit_config(path, **change)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_pretrained(path)
    assert "\n" not in str(e.value)


# Windows that mask nothing within max_position_embeddings: a Qwen2 config as transformers v4 writes it (a window
# shorter than the context, switched off), Qwen's window switched on but as long as the context, Mistral's as long.
WINDOWS_MASKING_NOTHING = {
    "qwen2": {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 0, "layer_types": None},
    "qwen3": {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1, "layer_types": None,
              "max_position_embeddings": 64},
    "mistral": {"sliding_window": 64, "max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", list(WINDOWS_MASKING_NOTHING))
def test_windows_that_mask_nothing_load_the_same_model(tmp_path, name):
    path = copy_fixture(tmp_path, name)
    edit_config(path, **WINDOWS_MASKING_NOTHING[name])
    assert load_pretrained(path)[0] == load_pretrained(FIXTURES / name)[0]


@LIVE
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral"])
def test_family_fixture_still_matches_transformers(name, tmp_path):
    """The golden logits are the installed transformers'; so are they with a window that masks nothing."""
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    assert rel_err(transformers_logits(FIXTURES / name, golden["ids"]), golden["logits"]) <= 1e-5
    path = copy_fixture(tmp_path, name)
    edit_config(path, **WINDOWS_MASKING_NOTHING[name])
    assert rel_err(transformers_logits(path, golden["ids"]), golden["logits"]) <= 1e-5


def family(name: str, tie: bool) -> ModelConfig:
    """A tiny transformer exporting as HF class `name` (GQA 4/2), with that class's attention options."""
    options = {"Qwen2ForCausalLM": {"qkv_bias": True}, "Qwen3ForCausalLM": {"qk_norm": True, "head_dim": 16}}
    return dataclasses.replace(tiny("transformer", tie), hf_class=name, **options.get(name, {}))


@LIVE
@pytest.mark.parametrize("name, tie", [("Qwen2ForCausalLM", False), ("Qwen2ForCausalLM", True),
                                       ("Qwen3ForCausalLM", False), ("Qwen3ForCausalLM", True),
                                       ("MistralForCausalLM", False)])
def test_family_export_loads_in_transformers_with_equal_logits(tmp_path, name, tie):
    """A diffjax model with random biases and q/k norm scales, exported: transformers loads it as `name` and
    computes its logits; it reloads as the same model."""
    cfg = family(name, tie)
    params = trained_diff(cfg)
    save_pretrained(cfg, params, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [name]
    ids = np.arange(24).reshape(2, 12) * 7 % cfg.vocab_size
    err = rel_err(logits(cfg, params, ids), transformers_logits(tmp_path, ids))
    print(f"{name} (tied {tie}): max relative logit error vs transformers {err:.2e}")
    assert err <= 1e-4
    assert load_pretrained(tmp_path)[0] == cfg

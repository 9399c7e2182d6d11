"""Hugging Face checkpoints in and out: golden DiffLlama / Llama fixtures (made by
tests/fixtures/hf/make_fixtures.py) load with their logits; exports reload equal, and load in transformers equal
where torch is installed; bad directories are refused by name."""

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from diffjax.config import ConfigError, ModelConfig
from diffjax.hf import load_pretrained, mapping, save_pretrained
from diffjax.model import DecoderLM

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY_DIFF = ModelConfig(arch="diff", vocab_size=96, d_model=32, n_layers=2, n_heads=2, head_dim=8, n_kv_heads=1,
                        ffn_dim=48, rope_theta=500.0, dtype="float32")


def logits(cfg, params, ids):
    return np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, jnp.asarray(ids)))


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", ["diffllama", "llama"])
def test_golden_hf_checkpoint_loads_with_equal_logits(name):
    cfg, params = load_pretrained(FIXTURES / name)
    assert cfg.arch == {"diffllama": "diff", "llama": "transformer"}[name] and cfg.kv_heads < cfg.n_heads
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    assert rel_err(logits(cfg, params, golden["ids"]), golden["logits"]) <= 1e-4


def trained_diff(cfg=TINY_DIFF, seed=0):
    """Initialised params perturbed everywhere, head-norm scale and λ vectors included (as training leaves them)."""
    params = nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
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


def test_golden_reexport_is_the_same_checkpoint(tmp_path):
    cfg, params = load_pretrained(FIXTURES / "diffllama")
    save_pretrained(cfg, params, tmp_path)
    ours, theirs = load_file(str(tmp_path / "model.safetensors")), load_file(str(FIXTURES / "diffllama" /
                                                                                  "model.safetensors"))
    assert set(ours) == set(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name].astype(np.float32), err_msg=name)


def copy_fixture(tmp_path, name="diffllama") -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
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
                            ({"headwise_norm": False}, "headwise_norm"), ({"lambda_init": 0.5}, "lambda_init")):
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

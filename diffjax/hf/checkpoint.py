"""HF-format directories (`config.json` + `model.safetensors`, or shards with `model.safetensors.index.json`)
read and written with safetensors' NumPy API: no torch needed."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import flax.linen as nn
import jax
import ml_dtypes  # noqa: F401  registers bfloat16 with NumPy: safetensors' NumPy API reads BF16 through it
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from diffjax.config import ConfigError, ModelConfig
from diffjax.hf import mapping
from diffjax.model import abstract_params
from diffjax.model.transformer import SCANNED

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
GENERATION = "generation_config.json"


EXPECTED = f"a Hugging Face model directory (config.json of a {' / '.join(mapping.FAMILIES)}, and its safetensors " \
           f"weights)"


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} does not exist; expected {EXPECTED}")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; expected {EXPECTED}")
    if not file.exists():
        raise ConfigError(f"{path} has no config.json, so it is not {EXPECTED}")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from e
    if "model" in config and "architectures" not in config:  # diffjax's own config.json
        raise ConfigError(f"{path} is a diffjax run directory, not {EXPECTED}; it is a run already (diffjax eval / "
                          f"train take it as --workdir), and `diffjax hf export --workdir {path} --out DIR` writes "
                          f"one as Hugging Face's")
    return config


def load_pretrained(path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, unrolled float32 NumPy params) of an HF directory of a class in `mapping.FAMILIES`."""
    path = Path(path)
    cfg = mapping.model_config(_read_config(path), str(path / "config.json"))
    if (path / INDEX).exists():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    elif (path / SINGLE).exists():
        weight_map = None
    else:
        raise ConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")
    handles = {}

    def get(name):
        file = SINGLE if weight_map is None else weight_map.get(name)
        if file is None:
            raise ConfigError(f"{path}: tensor {name!r} is missing (does config.json match the weights?)")
        if file not in handles:
            handles[file] = safe_open(path / file, framework="numpy")
        if name not in handles[file].keys():
            raise ConfigError(f"{path / file}: tensor {name!r} is missing (does config.json match the weights?)")
        return handles[file].get_tensor(name)

    params = mapping.from_hf(cfg, get)
    _check_shapes(cfg, params, path)
    return cfg, params


def _check_shapes(cfg: ModelConfig, params: dict, path: Path) -> None:
    expected = nn.meta.unbox(abstract_params(dataclasses.replace(cfg, scan_layers=False)))
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    for key, value in got:
        if key not in want or want[key].shape != value.shape:
            name = jax.tree_util.keystr(key)
            raise ConfigError(f"{path}: weight {name} has shape {value.shape}, config.json implies "
                              f"{want[key].shape if key in want else 'no such weight'} (mismatched config.json?)")


def save_pretrained(cfg: ModelConfig, params, path, *, tokenizer: str = "byte", max_shard_bytes: int = 5 << 30) -> None:
    """Write `params` (scanned or unrolled, boxed or not, sharded on devices or not) as an HF directory, with the
    special-token ids of diffjax's `tokenizer`; copied to the host a layer at a time, so no copy of the whole model."""
    path = Path(path)
    config = mapping.hf_config(cfg, tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    params = nn.meta.unbox(params)
    host = lambda tree: jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)  # noqa: E731
    top = host({k: v for k, v in params.items() if k in ("embed", "final_norm", "lm_head")})
    shards, current, size = [], {}, 0

    def add(tensors: dict):
        nonlocal current, size
        for name, array in tensors.items():
            if current and size + array.nbytes > max_shard_bytes:
                shards.append(_write_shard(path, len(shards), current))
                current, size = {}, 0
            current[name], size = array, size + array.nbytes

    add(mapping.top_to_hf(cfg, top))
    del top
    for i in range(cfg.n_layers):
        add(mapping.layer_to_hf(cfg, i, host(_layer(params, cfg, i))))
    if not shards:
        save_file(current, str(path / SINGLE), metadata={"format": "pt"})
        (path / INDEX).unlink(missing_ok=True)
    else:
        shards.append(_write_shard(path, len(shards), current))
        (path / SINGLE).unlink(missing_ok=True)  # HF would read a stale single file before the index
        total = len(shards)
        weight_map, total_size, total_parameters = {}, 0, 0
        for n, (tmp, names, nbytes, count) in enumerate(shards):
            final = f"model-{n + 1:05d}-of-{total:05d}.safetensors"
            (path / tmp).rename(path / final)
            weight_map |= dict.fromkeys(names, final)
            total_size, total_parameters = total_size + nbytes, total_parameters + count
        # as transformers writes it: the tensors' elements and bytes
        index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / GENERATION).write_text(json.dumps(mapping.generation_config(tokenizer, cfg.vocab_size), indent=2) + "\n")
    for file in path.glob("*.safetensors"):  # safetensors writes 0600; the other files follow the umask
        file.chmod(default_mode())


def default_mode(bits: int = 0o666) -> int:
    """`bits` less the process's umask: the mode a plain open() / mkdir() would give."""
    umask = os.umask(0)
    os.umask(umask)
    return bits & ~umask


def _layer(params: dict, cfg: ModelConfig, i: int) -> dict:
    """Layer i's subtree (a slice of a scanned stack)."""
    if cfg.scan_layers:
        return jax.tree.map(lambda x: x[i], params[SCANNED]["block"])
    return params[f"layer_{i}"]


def _write_shard(path: Path, n: int, tensors: dict) -> tuple[str, list[str], int, int]:
    """(file name, tensor names, their bytes, their elements) of shard n, written under a temporary name."""
    name = f"shard-{n}.tmp.safetensors"
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    return name, list(tensors), sum(t.nbytes for t in tensors.values()), sum(t.size for t in tensors.values())

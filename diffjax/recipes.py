"""The paper's model sizes and training recipes, and the CPU sizes: what config files build from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from diffjax.config import ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from diffjax.model import archs

# name: (d_model, layers, DIFF heads h, head dim d, ffn_dim or None for the 8/3 rule) — Tables 9 and 10.
PAPER_SIZES = {"830M": (1536, 24, 8, 96, None), "1.4B": (2048, 24, 8, 128, None), "2.8B": (2560, 32, 10, 128, None),
               "6.8B": (4096, 32, 16, 128, None), "13.1B": (5120, 40, 20, 128, None), "3B": (3072, 28, 12, 128, 8192)}
# CPU sizes: tiny (well under 1M parameters) and small (~10M), byte-level vocabulary.
SMALL_SIZES = {"tiny": (64, 2, 2, 16, None), "small": (384, 6, 3, 64, None)}
# How the paper's sizes run on accelerators (memory: docs/benchmarks.md, "Compiled memory of the paper's models").
PAPER_SCALE = {"scan_layers": True, "remat": "full", "loss_chunk": 512, "attention_impl": "auto"}
BYTE_VOCAB = 512  # 256 bytes + specials, padded to a multiple of 128


def data_source(path: str) -> str:
    """The `data.source` of a study's `data=` path: "shards" for a `diffjax prepare` output, else "text"."""
    from diffjax.data.prepare import METADATA

    return "shards" if (Path(path) / METADATA).is_file() else "text"


def parse_args(arg: str, file: str, defaults: dict[str, str]) -> dict[str, str]:
    """`"k=v,k2=v2"` -> {k: v} over `defaults`; a key not in `defaults` is an error naming the config file."""
    args = dict(defaults)
    for item in filter(None, (a.strip() for a in arg.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{file}: config argument {item!r}: expected key=value")
        if key.strip() not in defaults:
            raise ConfigError(f"{file}: unknown argument {key.strip()!r}; takes {sorted(defaults)}")
        args[key.strip()] = value.strip()
    return args


def size_arch_options(arg: str, file: str, default_size: str, options=("gate",)) -> tuple[str, str, dict]:
    """`"size=tiny,arch=gated,gate=elementwise"` -> ("tiny", "gated", {"gate": "elementwise"}): the size, the arch
    and the given `model.*` options that the parameter matching depends on."""
    args = parse_args(arg, file, {"size": default_size, "arch": "diff", **dict.fromkeys(options, "")})
    return args["size"], args["arch"], {k: args[k] for k in options if args[k]}


def model_config(size: str, arch: str, **overrides) -> ModelConfig:
    """The DIFF model of `size`, or the parameter-matched model of another arch (`archs.matched_shape`, which may
    depend on `overrides`, e.g. `gate="elementwise"`); explicit `n_heads` / `head_dim` overrides win."""
    table = PAPER_SIZES | SMALL_SIZES
    if size not in table:
        raise ConfigError(f"model size {size!r} unknown; choose one of {sorted(table)}")
    d_model, layers, h, d, ffn = table[size]
    vocab = BYTE_VOCAB if size in SMALL_SIZES else 100_288
    base = ModelConfig(arch=arch, vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=h, head_dim=d,
                       ffn_dim=ffn)
    heads, head_dim = archs.matched_shape(dataclasses.replace(base, **overrides), h, d)
    return dataclasses.replace(dataclasses.replace(base, n_heads=heads, head_dim=head_dim), **overrides)


def matched_rows(names, diff: ModelConfig, h: int, d: int) -> dict[str, dict]:
    """Sweep variants of the archs `names`, each matched in parameters to a DIFF model of h heads of d (`diff`: the
    base config, for its options)."""
    rows = {}
    for name in names:
        heads, head_dim = archs.matched_shape(dataclasses.replace(diff, arch=name), h, d)
        rows[name] = {"model.arch": name, "model.n_heads": heads, "model.head_dim": head_dim}
    return rows


def baseline_rows(arg: str, file: str, diff: ModelConfig) -> dict[str, dict]:
    """`"gated+sink"` -> `matched_rows` of those archs for the DIFF model `diff`; "" -> none."""
    names = [n for n in arg.split("+") if n] if arg else []
    if any(n not in archs.names() for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{file}: baselines must be distinct registered archs {archs.names()} joined by '+', "
                          f"got {arg!r}")
    return matched_rows(names, diff, diff.n_heads, diff.head_dim)


def diff_twin(cfg: ModelConfig) -> ModelConfig | None:
    """The DIFF model that `cfg`'s shape is parameter-matched to (h heads of d with `archs.matched_shape(cfg, h, d)` =
    (cfg.n_heads, cfg.head_dim), GQA's ratio kept): the recipe's DIFF of cfg's size if it is one, else the nearest
    matching shape (the head dim kept if possible); None for a DIFF model or when no DIFF shape maps to it."""
    if cfg.arch == "diff":
        return None
    recipe = [(h, d) for width, layers, h, d, _ in (PAPER_SIZES | SMALL_SIZES).values()
              if (width, layers) == (cfg.d_model, cfg.n_layers)]
    for h, d in recipe + [(h, d) for d in sorted(range(8, 4 * cfg.head_dim + 1, 2), key=lambda d: abs(d - cfg.head_dim))
                          for h in range(1, 2 * cfg.n_heads + 1)]:
        kv = None if cfg.n_kv_heads is None else cfg.n_kv_heads * h // cfg.n_heads
        if archs.matched_shape(cfg, h, d) == (cfg.n_heads, cfg.head_dim) and (
                kv is None or (kv > 0 and h % kv == 0 and kv * cfg.n_heads == cfg.n_kv_heads * h)):
            return dataclasses.replace(cfg, arch="diff", n_heads=h, head_dim=d, n_kv_heads=kv, gate=None)
    return None


def paper_recipe(size: str) -> tuple[OptimConfig, DataConfig, TrainConfig]:
    """Appendix E (Table 10 sizes, 40k steps of 0.25M tokens at 2048) or §3.1/Table 9 (3B, 4M at 4096)."""
    if size == "3B":
        optim = OptimConfig(lr=3.2e-4, final_lr=1.28e-5, warmup_steps=1000, b1=0.9, b2=0.95, weight_decay=0.1)
        data = DataConfig(source="text", path="data/", tokenizer="cl100k_base", seq_len=4096, batch_size=1024)
        return optim, data, TrainConfig(steps=250_000)
    lr = 1.5e-4 if size in ("830M", "1.4B", "2.8B") else 7.5e-5
    optim = OptimConfig(lr=lr, final_lr=0.0, warmup_steps=375, b1=0.9, b2=0.98, weight_decay=0.05)
    data = DataConfig(source="text", path="data/", tokenizer="cl100k_base", seq_len=2048, batch_size=128)
    return optim, data, TrainConfig(steps=40_000)


"""The config checks that need the registries (archs, kernels, sources, tokenizers, tasks), one step above
`diffjax.config`; every entry point runs `check` first, so a bad name fails as a ConfigError naming the field."""

from __future__ import annotations

from diffjax import config as config_lib
from diffjax import kernels
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, _fail
from diffjax.data import pipeline, sources, synthetic, tokenizer
from diffjax.model import archs


def load(spec: str, overrides=()) -> Config:
    """`config.load` (a config file with `--set` overrides), checked."""
    return check(config_lib.load(spec, overrides))


def check(cfg: Config, *, data: bool = True) -> Config:
    """`cfg.validate()`, then every check against the registries; returns `cfg`. `data=False` (an import, which
    reads no data): not the data source's and synthetic tasks' checks, made where the data is used."""
    cfg.validate()
    check_model(cfg.model)
    if data:
        check_data(cfg.data)
    check_context(cfg)
    tok = tokenizer.tokenizer_info(cfg.data.tokenizer)
    needed = tok.min_vocab_size
    if cfg.model.vocab_size < needed:
        _fail("model.vocab_size", f"{cfg.model.vocab_size} ids cannot embed the {tok.name} tokenizer's ids "
              f"(data.tokenizer={tok.name} produces ids up to {needed - 1}); set model.vocab_size={tok.vocab_size}")
    return cfg


def check_model(model: ModelConfig) -> ModelConfig:
    model.validate()
    archs.check(model)
    arch = archs.get(model.arch)
    ops, features = arch.ops, arch.op_features
    if model.lambda_ramp_steps and arch.layer_lambda is None:
        _fail("model.lambda_ramp_steps", f"arch {model.arch!r} has no λ to ramp (one λ per layer: "
              f"{tuple(n for n in archs.names() if archs.get(n).layer_lambda)})")
    impl = model.attention_impl
    if impl not in kernels.names():
        _fail("model.attention_impl", f"unknown impl {impl!r}; known: {kernels.names()}")
    if not ops and impl not in ("auto", "xla"):  # the arch computes its attention itself, in XLA
        _fail("model.attention_impl", f"arch {model.arch!r} computes its attention itself in XLA (no kernel op "
              f"computes it), so impl {impl!r} cannot run it; use 'auto' or 'xla'")
    for op in ops:
        if reason := kernels.refusal(impl, kernels.Call(op, features=features)):
            _fail("model.attention_impl", f"impl {impl!r} {reason}, which arch {model.arch!r} needs; use 'auto' "
                  f"(best available per op) or 'xla'")
    return model


def check_context(cfg: Config) -> None:
    """Context parallelism (`mesh.context` > 1): an arch that crosses the split, and an impl that can compute a
    block of it: auto, xla (the reference per block), or one with block kernels for each of the arch's ops."""
    if cfg.mesh.context == 1:
        return
    if not archs.get(cfg.model.arch).context_parallel:
        _fail("mesh.context", f"arch {cfg.model.arch!r} does not support context parallelism (its attention does not "
              f"cross a sequence split); set mesh.context=1 or use one of "
              f"{tuple(n for n in archs.names() if archs.get(n).context_parallel)}")
    impl, calls = cfg.model.attention_impl, [kernels.Call(op, split=True) for op in archs.get(cfg.model.arch).ops]
    refusals = [reason for call in calls if (reason := kernels.refusal(impl, call))]
    if refusals:
        fits = [n for n in kernels.names() if not any(kernels.refusal(n, call) for call in calls)]
        _fail("model.attention_impl", f"{impl!r} cannot run under context parallelism (mesh.context="
              f"{cfg.mesh.context}): it {refusals[0]}; use {' or '.join(fits)}")


def check_data(data: DataConfig) -> DataConfig:
    data.validate()
    if data.source not in pipeline.SOURCES:
        _fail("data.source", f"unknown source {data.source!r}; choose one of {pipeline.SOURCES}")
    try:  # a registered name, or a directory holding an HF tokenizer.json (read and checked here)
        tok = tokenizer.tokenizer_info(data.tokenizer)
    except ConfigError as e:
        _fail("data.tokenizer", str(e))
    if data.text_split not in sources.TEXT_SPLITS:
        _fail("data.text_split", f"unknown split {data.text_split!r}; choose one of {sources.TEXT_SPLITS}")
    if data.source == "synthetic":
        _check_tasks(data, tok)
    return data


def _check_tasks(data: DataConfig, tok) -> None:
    unknown = [t for t in data.tasks if t not in synthetic.TASKS]
    if not data.tasks or unknown or len(set(data.tasks)) != len(data.tasks):
        _fail("data.tasks", f"need distinct tasks from {synthetic.TASKS}, got {data.tasks}")
    if not 1 <= data.n_query_cities <= data.n_needles <= synthetic.MAX_NEEDLES:
        _fail("data.n_needles", f"need 1 <= n_query_cities ({data.n_query_cities}) <= n_needles "
              f"({data.n_needles}) <= {synthetic.MAX_NEEDLES}")
    misfit = synthetic.mqar_misfit(tok, data.mqar_vocab) if "mqar" in data.tasks else None
    if misfit:
        _fail(*misfit)
    if "retrieval" in data.tasks:  # needles that cannot fit the sequence: refused here, before a run writes anything
        try:
            synthetic.RetrievalTask(tokenizer.get_tokenizer(data.tokenizer), data.seq_len, data.n_needles,
                                    data.n_query_cities)
        except sources.DataError as e:
            _fail("data.seq_len", str(e).removeprefix("retrieval: "))

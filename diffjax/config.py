"""Frozen configuration dataclasses, config files (`"configs/x.py[:arg]"` -> `get_config(arg)`) and `a.b=c` overrides.

Plain data that imports no other part of diffjax: `validate()` checks what the config alone can say; the names that
other modules register (archs, impls, sources, tokenizers, tasks) are checked by `diffjax.checks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import types
import typing
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "attention")  # what the backward pass recomputes (docs/design.md §3)
CONTEXT_STRATEGIES = ("all_gather", "ring")  # attention across a sequence split over `mesh.context`
# RoPE frequency scaling (`model.rope_scaling`, transformers' rope_type) and the parameters each one takes.
ROPE_SCALINGS = {"none": (), "linear": ("rope_factor",),
                 "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                            "rope_original_max_positions")}
_REMAT_ALIASES = {"true": "full", "false": "none"}  # config.json before policies (a bool)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the reason."""


AT_STEP_0 = "it drew the initial parameters, at step 0"  # a fixed field's reason that an import (a step 0) may set


def setting(default, **rules):
    """A field with the rules its readers ask of it (`fields_where`); on a section, rules of each of its fields.
    free=True     a resume may change it: the trajectory stays the same (docs/training.md, "Resume")
    fixed=WHY     no resume may change it, nor an import but what acts `AT_STEP_0`; WHY ends the refusal's line
                  (neither: a resume with --allow-config-change applies it, unless it shapes the saved state)
    traced=True   a sweep's members may differ in it within one compiled program, as traced numbers (sweep/spec.py)
    state=NAME    the optimizer state holds it under NAME: traced, and written at a resume (train/optim.py)
    eval=True     `diffjax eval --set` may change it: where and on what a checkpoint is evaluated, not what it is"""
    return dataclasses.field(default=default, metadata=rules)


def _fail(field: str, reason: str):
    raise ConfigError(f"{field}: {reason}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = setting("diff", fixed="another arch reads the same arrays as other weights: diff's and dint's "
                                      "have the same shapes")
    vocab_size: int = 100_288
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 64
    n_kv_heads: int | None = None  # None: equal to n_heads (no GQA)
    ffn_dim: int | None = None  # None: the rule in `resolved_ffn_dim`
    rope_theta: float = 10_000.0
    # RoPE scaling as Llama checkpoints ship it (docs/design.md §2): the parameters it takes set, the others None.
    rope_scaling: str = "none"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_positions: int | None = None
    norm_eps: float = 1e-5
    # As Qwen checkpoints ship (docs/hf.md): biases on W_Q, W_K, W_V (Qwen2); an RMSNorm over each q and k head
    # before RoPE (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # The Hugging Face class `hf export` writes (an import keeps its checkpoint's); None: the arch's own.
    hf_class: str | None = setting(None, free=True)
    tie_embeddings: bool = False
    # None: the paper's schedule 0.8 − 0.6·exp(−0.3·(l−1)); a float: a constant
    lambda_init: float | None = setting(None, traced=True)
    # The forward uses min(1, step / N)·λ: the negative branch ramped in over N steps (0: off, λ at full weight;
    # docs/hf.md). Not optim.lambda_warmup_steps, which ramps λ's updates, not its value.
    lambda_ramp_steps: int = 0
    headwise_norm: bool | None = None  # None: on for "diff", off for "transformer", never for "diff_v2"
    gate: str | None = None  # "gated" only: "headwise" (per head and token) or "elementwise"; None: the default
    # "auto": the platform's fused kernel where there is one (docs/kernels.md)
    attention_impl: str = setting("auto", free=True, eval=True)
    context_strategy: str = setting("all_gather", free=True, eval=True)
    scan_layers: bool = False
    remat: str | bool = setting("none", free=True, eval=True)  # one of REMAT_POLICIES (true / false: "full" / "none")
    # Cross-entropy this many positions at a time; 0: chosen (`train.loss.resolved_chunk`).
    loss_chunk: int = setting(0, free=True, eval=True)
    dtype: str = "bfloat16"  # compute dtype; parameters are always float32
    init_std: float = setting(0.02, fixed=AT_STEP_0, traced=True)

    def __post_init__(self):
        if str(self.remat).lower() in _REMAT_ALIASES:
            object.__setattr__(self, "remat", _REMAT_ALIASES[str(self.remat).lower()])

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_ffn_dim(self) -> int:
        """8/3·d_model rounded up to a multiple of 128 (d_model 3072 → 8192 exactly, as Table 9)."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 128 * math.ceil(8 * self.d_model / 3 / 128)

    def validate(self) -> None:
        """Plain checks; the architecture's and the attention impl's are `diffjax.checks.check_model`'s."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim"):
            if getattr(self, name) <= 0:
                _fail(f"model.{name}", f"must be positive, got {getattr(self, name)}")
        if self.lambda_init is not None and not 0.0 < self.lambda_init < 1.0:
            _fail("model.lambda_init", f"a constant λ_init must lie in (0, 1), got {self.lambda_init}")
        if self.lambda_ramp_steps < 0:
            _fail("model.lambda_ramp_steps", f"must be >= 0 (0: off), got {self.lambda_ramp_steps}")
        if self.dtype not in DTYPES:
            _fail("model.dtype", f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.head_dim % 2:
            _fail("model.head_dim", f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.remat not in REMAT_POLICIES:
            _fail("model.remat", f"unknown policy {self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.loss_chunk < 0:
            _fail("model.loss_chunk", f"must be >= 0 (0: no chunking), got {self.loss_chunk}")
        if self.context_strategy not in CONTEXT_STRATEGIES:
            _fail("model.context_strategy", f"unknown strategy {self.context_strategy!r}; choose one of "
                  f"{CONTEXT_STRATEGIES}")
        self._validate_rope()

    def _validate_rope(self) -> None:
        if self.rope_theta <= 0:
            _fail("model.rope_theta", f"must be positive, got {self.rope_theta}")
        if self.rope_scaling not in ROPE_SCALINGS:
            _fail("model.rope_scaling", f"unknown scaling {self.rope_scaling!r}; choose one of {tuple(ROPE_SCALINGS)}")
        takes = ROPE_SCALINGS[self.rope_scaling]
        for name in ROPE_SCALINGS["llama3"]:  # every parameter: set exactly when the scaling takes it
            value = getattr(self, name)
            if value is None and name in takes:
                _fail(f"model.{name}", f"rope_scaling {self.rope_scaling!r} needs it")
            if value is not None and name not in takes:
                _fail(f"model.{name}", f"rope_scaling {self.rope_scaling!r} does not take it (got {value}); set it "
                      f"to None")
            if value is not None and value <= 0:
                _fail(f"model.{name}", f"must be positive, got {value}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            _fail("model.rope_high_freq_factor", f"must exceed rope_low_freq_factor ({self.rope_low_freq_factor}), "
                  f"got {self.rope_high_freq_factor}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | text | jsonl | shards (the output of `diffjax prepare`)
    path: str | None = None  # file or directory for text / jsonl / shards
    text_field: str = "text"  # the JSONL field holding the document
    text_split: str = "paragraph"  # text documents: blank-line-separated paragraphs, or one per "file"
    # byte | cl100k_base | a directory holding an HF tokenizer.json (a run keeps a copy)
    tokenizer: str = setting("byte", fixed="the embedding's rows are this tokenizer's tokens")
    seq_len: int = 256
    batch_size: int = 16  # global batch, in sequences
    val_fraction: float = 0.05
    seed: int = setting(0, traced=True)  # the training batches' order (a vary_data sweep gives each member its own)
    split_seed: int = 0  # the train / validation split and the synthetic validation examples (shared by members)
    num_workers: int = setting(0, free=True)  # Grain worker processes (0: in-process)
    tasks: tuple[str, ...] = ("retrieval", "mqar")  # the synthetic tasks' mixture (docs/design.md §5)
    task_weights: tuple[float, ...] = ()  # mixture proportions in `tasks` order; empty: equal
    n_needles: int = 4
    n_query_cities: int = 1
    mqar_pairs: int = 8
    mqar_queries: int = 8
    mqar_vocab: int = 64  # size of each of the disjoint key / value / noise id ranges

    def validate(self) -> None:
        """Plain checks; names of sources, tokenizers and tasks are `diffjax.checks.check_data`'s."""
        if self.source != "synthetic" and not self.path:
            _fail("data.path", f"source {self.source!r} needs a path")
        if self.path and self.path.startswith(("gs://", "s3://")):  # the pipeline reads with local file APIs
            _fail("data.path", f"{self.path}: data is read from a local or shared filesystem; copy the shards there "
                  f"first (gcloud storage cp -r / aws s3 cp --recursive) and give that path")
        if self.seq_len <= 1 or self.batch_size <= 0:
            _fail("data.seq_len" if self.seq_len <= 1 else "data.batch_size", "must be positive (seq_len > 1)")
        if not 0.0 <= self.val_fraction < 1.0:
            _fail("data.val_fraction", f"must lie in [0, 1), got {self.val_fraction}")
        if self.num_workers < 0:
            _fail("data.num_workers", f"must be >= 0, got {self.num_workers}")
        for name in ("seed", "split_seed"):
            if not 0 <= getattr(self, name) < 2**32:
                _fail(f"data.{name}", f"must lie in [0, 2**32), got {getattr(self, name)}")
        if self.task_weights and (len(self.task_weights) != len(self.tasks) or min(self.task_weights) < 0
                                  or sum(self.task_weights) <= 0):
            _fail("data.task_weights", f"need one non-negative weight per task {self.tasks} with a positive sum, "
                  f"got {self.task_weights}")
        if not 1 <= self.mqar_pairs <= self.mqar_vocab or self.mqar_queries < 1:
            _fail("data.mqar_pairs", f"need 1 <= mqar_pairs ({self.mqar_pairs}) <= mqar_vocab ({self.mqar_vocab}) "
                  f"and mqar_queries ({self.mqar_queries}) >= 1")
        if self.source == "synthetic" and "mqar" in self.tasks and \
                2 * (self.mqar_pairs + self.mqar_queries) > self.seq_len + 1:
            _fail("data.seq_len", f"{self.seq_len} is too short for {self.mqar_pairs} MQAR pairs and "
                  f"{self.mqar_queries} queries")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(3e-4, traced=True, state="peak_lr")  # peak learning rate
    final_lr: float = setting(3e-5, traced=True, state="final_lr")  # reached at the last step by linear decay
    warmup_steps: int = 100
    b1: float = setting(0.9, traced=True, state="b1")
    b2: float = setting(0.95, traced=True, state="b2")
    eps: float = setting(1e-8, traced=True, state="eps")
    weight_decay: float = setting(0.1, traced=True, state="weight_decay")
    decay_embeddings: bool = True
    clip_norm: float = setting(1.0, traced=True, state="max_norm")  # global-norm clipping; 0 disables
    grad_accum: int = 1
    max_nonfinite: int = 10  # non-finite steps are skipped; this many in a row stop the run
    lambda_warmup_steps: int = 0  # λ's updates ramp 0 → 1 over this many steps (0: off; docs/hf.md)
    lambda_lr_scale: float = 1.0  # λ's vectors' learning rate: optim.lr's schedule × this (docs/hf.md)

    def validate(self) -> None:
        if self.lr <= 0 or self.final_lr < 0 or self.final_lr > self.lr:
            _fail("optim.lr", f"need 0 <= final_lr ({self.final_lr}) <= lr ({self.lr}) and lr > 0")
        if self.warmup_steps < 0 or self.grad_accum < 1 or self.max_nonfinite < 1:
            _fail("optim", "warmup_steps >= 0, grad_accum >= 1 and max_nonfinite >= 1 are required")
        if self.lambda_warmup_steps < 0:
            _fail("optim.lambda_warmup_steps", f"must be >= 0 (0: off), got {self.lambda_warmup_steps}")
        if self.lambda_lr_scale <= 0:
            _fail("optim.lambda_lr_scale", f"must be positive, got {self.lambda_lr_scale}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    seed: int = setting(0, fixed=AT_STEP_0, traced=True)
    log_every: int = setting(10, free=True)
    eval_every: int = setting(200, free=True)
    eval_batches: int = setting(4, free=True, eval=True)
    checkpoint_every: int = setting(200, free=True)
    keep_checkpoints: int = setting(3, free=True)
    workdir: str = setting("runs/default", free=True)
    telemetry_every: int = setting(100, free=True)  # attention telemetry on a fixed probe (train/telemetry.py); 0: off
    telemetry_rows: int = setting(2, free=True)  # the probe: this many rows of the first validation batch

    def validate(self) -> None:
        for name in ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
                     "telemetry_rows"):
            if getattr(self, name) <= 0:
                _fail(f"train.{name}", f"must be positive, got {getattr(self, name)}")
        if self.telemetry_every < 0:
            _fail("train.telemetry_every", f"must be 0 (off) or positive, got {self.telemetry_every}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: all devices not used by the other axes
    fsdp: int = 1
    tensor: int = 1
    context: int = 1  # context parallelism: the sequence split over this many devices (docs/design.md §3)

    def validate(self) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            _fail("mesh", f"axis sizes must be positive with at most one -1, got {sizes}")
        if self.context < 1:
            _fail("mesh.context", f"must be a positive number of devices (1: no context parallelism), got "
                  f"{self.context}")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = setting(DataConfig(), eval=True)  # eval --set: the evaluation data
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = setting(MeshConfig(), free=True, eval=True)
    name: str = setting("unnamed", free=True)

    def validate(self) -> Config:
        for section in (self.model, self.data, self.optim, self.train, self.mesh):
            section.validate()
        if self.model.loss_chunk and self.data.seq_len % self.model.loss_chunk:
            _fail("model.loss_chunk", f"{self.model.loss_chunk} must divide data.seq_len ({self.data.seq_len})")
        n = self.mesh.context
        if n > 1 and self.data.seq_len % (2 * n):  # the load-balanced layout cuts the sequence into 2n chunks
            _fail("data.seq_len", f"{self.data.seq_len} must be divisible by 2 × mesh.context = {2 * n} (context "
                  f"parallelism cuts the sequence into {2 * n} chunks, two per device)")
        if n > 1 and self.model.loss_chunk and (self.data.seq_len // n) % self.model.loss_chunk:
            _fail("model.loss_chunk", f"{self.model.loss_chunk} must divide each device's share of the sequence, "
                  f"data.seq_len / mesh.context = {self.data.seq_len // n}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def fields_where(rule: str) -> dict[str, object]:
    """{"section.field" (or "name"): its `rule`'s value} for every field that has the rule (`setting`); a section
    that has it is listed too, as "section.*", and gives it to each of its fields."""
    found = {}
    for top in dataclasses.fields(Config):
        fields = dataclasses.fields(top.default) if dataclasses.is_dataclass(top.default) else ()
        named = [(f"{top.name}.*" if fields else top.name, top.metadata)]
        named += [(f"{top.name}.{f.name}", top.metadata | f.metadata) for f in fields]
        found |= {name: rules[rule] for name, rules in named if rule in rules}
    return found


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict` (lists become tuples where the field is a tuple)."""
    data = d.get("data", {})
    if data and "split_seed" not in data:  # written before the split had its own seed: it followed data.seed
        d = {**d, "data": {**data, "split_seed": data.get("seed", 0)}}
    sections = {}
    for name, cls in typing.get_type_hints(Config).items():
        if name != "name":
            hints = typing.get_type_hints(cls)
            sections[name] = cls(**{k: coerce(v, hints[k], f"{name}.{k}") for k, v in d.get(name, {}).items()})
    return Config(**sections, name=d.get("name", "unnamed")).validate()


_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}  # the Python values each type takes
_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


def coerce(value, typ, field: str):
    """Check `value` against the annotated type `typ` and convert strings / JSON values to it."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(typ)
        if type(None) in options and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(value, option, field)
            except ConfigError as e:
                errors.append(str(e))
        _fail(field, f"cannot use {value!r}: " + "; ".join(errors))
    if origin is tuple:
        (item,) = typing.get_args(typ)[:1]
        if isinstance(value, str):
            value = [v for v in value.replace("+", ",").split(",") if v]
        if not isinstance(value, list | tuple):
            _fail(field, f"expected a list, got {value!r}")
        return tuple(coerce(v, item, field) for v in value)
    if typ in _SCALARS:
        if isinstance(value, str) and typ is not str:  # the text form: an override, a sweep axis
            with contextlib.suppress(KeyError, ValueError):
                return _BOOL_WORDS[value.lower()] if typ is bool else typ(value)
        elif isinstance(value, _SCALARS[typ]) and (typ is bool or not isinstance(value, bool)):
            return typ(value)
        _fail(field, f"expected {'an int' if typ is int else 'a string' if typ is str else 'a ' + typ.__name__}, "
              f"got {value!r}")
    return value


def override(cfg: Config, assignment: str) -> Config:
    """Apply one `section.field=value` override (e.g. `model.n_layers=2`, `optim.lr=1e-3`)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r}: expected the form section.field=value")
    key, value = assignment.split("=", 1)
    return replace_field(cfg, key.strip(), value.strip())


def replace_field(cfg: Config, key: str, value) -> Config:
    """`cfg` with the field `section.field` (or `name`) set to `value`: a Python value or its text form."""
    if key == "name":
        return dataclasses.replace(cfg, name=str(value))
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in {f.name for f in dataclasses.fields(Config)}:
        raise ConfigError(f"unknown override key {key!r}: expected section.field with a section in "
                          f"{[f.name for f in dataclasses.fields(Config) if f.name != 'name']}")
    section_name, field = parts
    section = getattr(cfg, section_name)
    types_ = typing.get_type_hints(type(section))
    if field not in types_:
        raise ConfigError(f"unknown override key {key!r}: {section_name} has no field {field!r}; "
                          f"fields: {sorted(types_)}")
    new_section = dataclasses.replace(section, **{field: coerce(value, types_[field], key)})
    return dataclasses.replace(cfg, **{section_name: new_section})


SHIPPED = Path(__file__).parent / "configs"  # the config files installed with the package


def shipped_configs() -> list[str]:
    return sorted(f"configs/{p.name}" for p in SHIPPED.glob("*.py"))


def find_config(path: str) -> Path:
    """`path` itself, or the shipped file it names (`configs/main.py`, `main.py` or `main`), from any directory."""
    file = Path(path)
    if file.is_file():
        return file
    name = file.name if file.suffix == ".py" else f"{file.name}.py"
    if not file.is_absolute() and file.parent in (Path("."), Path("configs")) and (SHIPPED / name).is_file():
        return SHIPPED / name
    raise ConfigError(f"config file {path!r} not found (shipped configs: {', '.join(shipped_configs())})")


def call_file(spec: str, function: str, kind: type):
    """`"path/to/file.py[:arg]"` -> `function(arg)` defined in that file, checked to be a `kind`."""
    path, _, arg = spec.partition(":")
    file = find_config(path)
    module_spec = importlib.util.spec_from_file_location(f"_diffjax_{function}_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:  # the user's own file: where, not a traceback through importlib
        raise ConfigError(f"{e.filename}:{e.lineno}: syntax error in config file: {e.msg}") from None
    if not hasattr(module, function):
        raise ConfigError(f"config file {path!r} defines no {function}(arg)")
    result = getattr(module, function)(arg)
    if not isinstance(result, kind):
        raise ConfigError(f"{path}: {function}({arg!r}) returned {type(result).__name__}, not "
                          f"{kind.__module__}.{kind.__name__}")
    return result


def load(spec: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Load `"path/to/config.py[:arg]"`, apply `a.b=c` overrides and validate."""
    cfg = call_file(spec, "get_config", Config)
    for assignment in overrides:
        cfg = override(cfg, assignment)
    return cfg.validate()

"""The pure name/array mapping between diffjax params and HF state dicts (NumPy only): DiffLlama, Llama, Mistral,
Qwen2 and Qwen3.

The mapping (sub-head order, the head-norm scale folded into o_proj): docs/design.md §2, "Hugging Face".
"""

from __future__ import annotations

import dataclasses
import json
import typing

import numpy as np

from diffjax import checks
from diffjax.config import ROPE_SCALINGS, ConfigError, ModelConfig, coerce
from diffjax.data.tokenizer import HFTokenizer, tokenizer_info
from diffjax.model import archs
from diffjax.model.archs.diff import LAMBDA_PARAMS

DIFF_CLASS, LLAMA_CLASS = "DiffLlamaForCausalLM", "LlamaForCausalLM"
CLASSES = {"diff": DIFF_CLASS, "transformer": LLAMA_CLASS}  # each arch's own class (model.hf_class=None)
# transformers' rope_type → model.rope_scaling, and each scaling parameter's key in HF's rope_parameters.
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
ROPE_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
             "rope_high_freq_factor": "high_freq_factor",
             "rope_original_max_positions": "original_max_position_embeddings"}
# HF config fields that change what the model computes, with the only value diffjax computes (null: unset).
ONLY_VALUES = {"hidden_act": "silu", "partial_rotary_factor": 1.0}
NO_WINDOW = {"sliding_window": None, "use_sliding_window": False}  # Llama's and Qwen's spelling of no window


@dataclasses.dataclass(frozen=True)
class Family:
    """An HF class diffjax reads and writes: its arch and model_type, the attention options its weights have, the
    config fields it reads with the only value diffjax computes (checked on import, written on export), and how it
    reads a sliding window: None (it computes none: a set `NO_WINDOW` field is refused), "all" (every layer:
    Mistral) or "qwen" (`use_sliding_window`, `max_window_layers`, `layer_types`)."""

    arch: str
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    only: dict = dataclasses.field(default_factory=dict)
    window: str | None = None
    # What transformers' config class fills in for a key config.json leaves out, where it is not Llama's (KV heads =
    # heads, head_dim = hidden / heads, rms_norm_eps 1e-6, θ 10,000, untied): each family's own.
    defaults: dict = dataclasses.field(default_factory=dict)

    def checked(self) -> dict:
        """The config fields an import checks for their only value (a window is checked by `_check_window`)."""
        return ONLY_VALUES | self.only | (NO_WINDOW if self.window is None else {})

    def written(self) -> dict:
        """The config fields an export writes for `only` and for no sliding window."""
        return self.only | {None: {}, "all": {"sliding_window": None}, "qwen": NO_WINDOW}[self.window]


LLAMA_ONLY = {"attention_bias": False, "mlp_bias": False}
QWEN_DEFAULTS = {"num_key_value_heads": 32, "max_position_embeddings": 32768}
FAMILIES = {DIFF_CLASS: Family("diff", "diffllama", only=LLAMA_ONLY, defaults={"rms_norm_eps": 1e-5}),
            LLAMA_CLASS: Family("transformer", "llama", only=LLAMA_ONLY),
            "MistralForCausalLM": Family("transformer", "mistral", window="all", defaults={
                "num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 131072}),
            "Qwen2ForCausalLM": Family("transformer", "qwen2", qkv_bias=True, window="qwen",  # o_proj has no bias
                                       defaults=QWEN_DEFAULTS),
            # Qwen3's attention_bias would add an o_proj bias too
            "Qwen3ForCausalLM": Family("transformer", "qwen3", qk_norm=True, only={"attention_bias": False},
                                       window="qwen", defaults=QWEN_DEFAULTS | {"head_dim": 128})}
MLP = (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))  # HF's names and diffjax's


def interleave(n: int) -> np.ndarray:
    """diffjax sub-head j ← HF sub-head order[j] for n pairs: [0, n, 1, n+1, …]."""
    return np.stack([np.arange(n), np.arange(n, 2 * n)], axis=1).reshape(-1)


def _rows(w: np.ndarray, order: np.ndarray, d: int) -> np.ndarray:
    """Reorder the head blocks (of d rows) of a [heads·d, in] torch weight."""
    return w.reshape(len(order), d, -1)[order].reshape(w.shape)


def token_ids(tokenizer: str, vocab_size: int) -> dict:
    """The special-token ids of data.tokenizer `tokenizer`, as transformers names them. EOS stands as BOS where the
    tokenizer has none (a document's end also separates it from the next: what generate() feeds an empty prompt).
    Left out: ids past the model's `vocab_size` (transformers refuses a pad id past its embedding table), and the
    made-up pad id of an HF tokenizer without a pad token (the exported tokenizer.json has no such id)."""
    tok = tokenizer_info(tokenizer)
    bos = tok.eos_id if tok.bos_id is None else tok.bos_id
    ids = {"bos_token_id": bos, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    if isinstance(tok, HFTokenizer) and "pad" not in tok.tokens:
        del ids["pad_token_id"]
    return {name: i for name, i in ids.items() if i < vocab_size}


def generation_config(tokenizer: str, vocab_size: int) -> dict:
    """generation_config.json: generate() stops at the end of a document and pads with diffjax's pad id."""
    return {**token_ids(tokenizer, vocab_size), "_from_model_config": False}


def export_class(cfg: ModelConfig) -> str:
    """The HF class a diffjax model exports as: `model.hf_class`, else its arch's; refuses a model that class does
    not compute (each refusal names the field)."""
    if cfg.arch not in CLASSES:
        raise ConfigError(f"model.arch: {cfg.arch!r} has no Hugging Face class (exportable: {tuple(CLASSES)})")
    name = cfg.hf_class or CLASSES[cfg.arch]
    if name not in FAMILIES or FAMILIES[name].arch != cfg.arch:
        writable = tuple(n for n, f in FAMILIES.items() if f.arch == cfg.arch)
        raise ConfigError(f"model.hf_class: {name!r} is not a class a model.arch={cfg.arch!r} exports as (one of "
                          f"{writable})")
    family, options = FAMILIES[name], (cfg.qkv_bias, cfg.qk_norm)
    for field, has in (("qkv_bias", family.qkv_bias), ("qk_norm", family.qk_norm)):
        if getattr(cfg, field) != has:
            fits = [n for n, f in FAMILIES.items() if f.arch == cfg.arch and (f.qkv_bias, f.qk_norm) == options]
            raise ConfigError(f"model.{field}: {name} has {'no ' if not getattr(family, field) else ''}{field}, "
                              f"so this model cannot be exported as one"
                              + (f"; set model.hf_class={fits[0]}" if fits else " (no class diffjax writes has it)"))
    return name


def hf_config(cfg: ModelConfig, tokenizer: str) -> dict:
    """The HF config.json of a diffjax model trained with `tokenizer` (refuses what the HF class cannot represent)."""
    diff = cfg.arch == "diff"
    if diff and not archs.uses_headwise_norm(cfg):
        raise ConfigError("model.headwise_norm: DiffLlama always applies its per-head RMSNorm, so a DIFF model "
                          "without it (a Llama converted with --as diff) has no Hugging Face class; the run itself "
                          "serves diffjax eval, lm-eval and generate, and the checkpoint fine-tuned without --as diff "
                          "exports as its own class")
    name = export_class(cfg)
    if not diff and archs.uses_headwise_norm(cfg):
        raise ConfigError(f"model.headwise_norm: {name} has no per-head output norm; this Transformer cannot be "
                          f"exported")
    if cfg.lambda_init is not None:
        raise ConfigError("model.lambda_init: DiffLlama uses the λ_init schedule; a constant λ_init cannot be "
                          "exported")
    sub, family = 2 if diff else 1, FAMILIES[name]
    return {"architectures": [name], "model_type": family.model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": sub * cfg.n_heads,
            "num_key_value_heads": sub * cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters(cfg), "rope_theta": cfg.rope_theta, **family.written(),
            "max_position_embeddings": max_positions(cfg), "dtype": "float32", **token_ids(tokenizer, cfg.vocab_size)}


def rope_parameters(cfg: ModelConfig) -> dict:
    """HF's rope_parameters of the model's RoPE (its rope_type and that type's keys)."""
    rope_type = {v: k for k, v in ROPE_TYPES.items()}[cfg.rope_scaling]
    return {"rope_type": rope_type, "rope_theta": cfg.rope_theta,
            **{ROPE_KEYS[name]: getattr(cfg, name) for name in ROPE_SCALINGS[cfg.rope_scaling]}}


def max_positions(cfg: ModelConfig) -> int:
    """HF's max_position_embeddings (which changes no logits): 8192, or the context a llama3 scaling extends its
    original one to (transformers warns unless it exceeds original_max_position_embeddings)."""
    return max(8192, int(cfg.rope_factor * cfg.rope_original_max_positions)) if cfg.rope_scaling == "llama3" else 8192


def rope_fields(hf: dict, where: str) -> dict:
    """ModelConfig's rope_* fields from an HF config, read as transformers reads them: the v4 `rope_scaling` dict
    over the v5 `rope_parameters` one; θ from the dict, else the top level; a llama3 scaling's original context from
    the top level, else the dict, else `max_position_embeddings`."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: {key}.rope_type={json.dumps(rope_type)} is not supported (diffjax computes "
                          f"{', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        raise ConfigError(f"{where}: {key}.partial_rotary_factor={json.dumps(rope['partial_rotary_factor'])} is not "
                          f"supported (diffjax rotates the whole head)")
    if rope_type == "llama3":
        context = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope = {**rope, "original_max_position_embeddings": context or hf.get("max_position_embeddings")}
    scaling, types = ROPE_TYPES[rope_type], typing.get_type_hints(ModelConfig)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    fields = {"rope_scaling": scaling, "rope_theta": coerce(theta, float, f"{where}: rope_theta")}
    for name in ROPE_SCALINGS[scaling]:
        if rope.get(ROPE_KEYS[name]) is None:
            raise ConfigError(f"{where}: {key} of rope_type {rope_type!r} has no {ROPE_KEYS[name]!r}")
        number = typing.get_args(types[name])[0]  # the field's type without its None
        fields[name] = coerce(rope[ROPE_KEYS[name]], number, f"{where}: {key}.{ROPE_KEYS[name]}")
    return fields


def model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """The diffjax ModelConfig of an HF config.json dict (a clear ConfigError for what does not fit)."""
    classes = hf.get("architectures") or []
    if len(classes) != 1 or classes[0] not in FAMILIES:
        raise ConfigError(f"{where}: architectures {classes} — diffjax loads only {', '.join(FAMILIES)}")
    name = classes[0]
    family = FAMILIES[name]
    hf = family.defaults | hf
    arch = family.arch
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise ConfigError(f"{where}: missing or non-integer {key!r}")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    for key, value in family.checked().items():
        if hf.get(key) is not None and hf[key] != value:
            raise ConfigError(f"{where}: {key}={json.dumps(hf[key])} is not supported (diffjax computes only "
                              f"{key}={json.dumps(value)})")
    _check_window(hf, family, where)
    if arch == "diff":
        if heads % 2 or kv % 2:
            raise ConfigError(f"{where}: DiffLlama needs even num_attention_heads and num_key_value_heads (Q1/Q2 "
                              f"halves), got {heads} and {kv}")
        heads, kv = heads // 2, kv // 2
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = {"float16": "bfloat16"}.get(dtype, dtype)  # float16 storage computes in bfloat16: no loss scaling here
    cfg = ModelConfig(arch=arch, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                      n_layers=hf["num_hidden_layers"], n_heads=heads, head_dim=head_dim, n_kv_heads=kv,
                      ffn_dim=hf["intermediate_size"], **rope_fields(hf, where),
                      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=family.qkv_bias,
                      qk_norm=family.qk_norm, hf_class=None if name == CLASSES[arch] else name,
                      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      dtype=dtype if dtype in ("float32", "bfloat16") else "float32")
    try:
        checks.check_model(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: does not fit a diffjax model: {e}") from e
    return cfg


def _check_window(hf: dict, family: Family, where: str) -> None:
    """Refuse a sliding window that masks a key within `max_position_embeddings`, each layer's read as transformers
    reads it (Mistral: every layer; Qwen: `layer_types`, else the layers from `max_window_layers` on, under
    `use_sliding_window`): diffjax attends to every earlier position."""
    if family.window is None:
        return
    window = hf.get("sliding_window") if family.window == "all" or hf.get("use_sliding_window") else None
    n = hf["num_hidden_layers"]
    if family.window == "all":
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    else:
        first = hf.get("max_window_layers", 28)  # transformers' default
        types = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= first
                                          else "full_attention" for i in range(n)]
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise ConfigError(f"{where}: layer_types {json.dumps(other)} is not supported (diffjax computes only "
                          f"full_attention)")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    context = hf.get("max_position_embeddings")
    if sliding and (window is None or context is None or window < context):
        raise ConfigError(f"{where}: sliding_window={json.dumps(window)} is not supported (layers {sliding} slide, "
                          f"max_position_embeddings={json.dumps(context)}): diffjax attends to every earlier position, "
                          f"so it loads only a window of at least max_position_embeddings")


def top_to_hf(cfg: ModelConfig, top: dict) -> dict[str, np.ndarray]:
    """HF tensors of the embedding, final norm and head from unboxed NumPy params."""
    out = {"model.embed_tokens.weight": top["embed"]["embedding"], "model.norm.weight": top["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = top["lm_head"]["kernel"].T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def layer_to_hf(cfg: ModelConfig, i: int, layer: dict) -> dict[str, np.ndarray]:
    """HF tensors of layer i from its unboxed NumPy params."""
    p, attn, d = f"model.layers.{i}.", layer["attn"], cfg.head_dim
    q, k, v, o = (attn[n]["kernel"].T for n in ("wq", "wk", "wv", "wo"))  # torch [out, in]
    out = {}
    if cfg.arch == "diff":  # diffjax sub-head j holds HF sub-head order[j]: invert the interleave
        pairs = ((q, cfg.n_heads), (k, cfg.kv_heads), (v, cfg.kv_heads))
        q, k, v = (_rows(w, np.argsort(interleave(n)), d) for w, n in pairs)
        o = o * np.tile(attn["head_norm"]["scale"], cfg.n_heads)[None, :]  # the scale of every head's 2d channels
        out |= {p + "self_attn." + n: attn[n] for n in LAMBDA_PARAMS}
    out |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": o, p + "input_layernorm.weight": layer["attn_norm"]["scale"],
            p + "post_attention_layernorm.weight": layer["mlp_norm"]["scale"]}
    if cfg.qkv_bias:  # a transformer's only (export_class): no sub-head order to invert
        out |= {p + f"self_attn.{n}_proj.bias": attn[f"w{n}"]["bias"] for n in "qkv"}
    if cfg.qk_norm:
        out |= {p + f"self_attn.{n}.weight": attn[n]["scale"] for n in ("q_norm", "k_norm")}
    out |= {p + f"mlp.{hf_name}.weight": layer["mlp"][name]["kernel"].T for hf_name, name in MLP}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(cfg: ModelConfig, get) -> dict:
    """Unrolled diffjax params (NumPy float32) from an HF state dict read by `get(name) -> array`."""
    diff, d = cfg.arch == "diff", cfg.head_dim
    f32 = lambda name: np.asarray(get(name), np.float32)  # noqa: E731
    params = {"embed": {"embedding": f32("model.embed_tokens.weight")},
              "final_norm": {"scale": f32("model.norm.weight")}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": f32("lm_head.weight").T}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        q, k, v, o = (f32(p + f"self_attn.{n}_proj.weight") for n in "qkvo")
        attn = {}
        if diff:
            q, k, v = (_rows(w, interleave(n), d) for w, n in ((q, cfg.n_heads), (k, cfg.kv_heads), (v, cfg.kv_heads)))
            attn |= {n: f32(p + "self_attn." + n) for n in LAMBDA_PARAMS}
            attn["head_norm"] = {"scale": np.ones(2 * d, np.float32)}  # HF's per-head norm has no weight
        attn |= {"wq": {"kernel": q.T}, "wk": {"kernel": k.T}, "wv": {"kernel": v.T}, "wo": {"kernel": o.T}}  # views
        if cfg.qkv_bias:  # a transformer's only (FAMILIES)
            for n in "qkv":
                attn[f"w{n}"]["bias"] = f32(p + f"self_attn.{n}_proj.bias")
        if cfg.qk_norm:
            attn |= {n: {"scale": f32(p + f"self_attn.{n}.weight")} for n in ("q_norm", "k_norm")}
        mlp = {name: {"kernel": f32(p + f"mlp.{hf_name}.weight").T} for hf_name, name in MLP}
        params[f"layer_{i}"] = {"attn": attn, "mlp": mlp, "attn_norm": {"scale": f32(p + "input_layernorm.weight")},
                                "mlp_norm": {"scale": f32(p + "post_attention_layernorm.weight")}}
    return params

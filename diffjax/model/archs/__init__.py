"""Architectures by name: one `Arch` per `model.arch` owns everything that varies by architecture; adding one is a
file here that calls `register(...)`, imported at the bottom (docs/design.md, "Extension points", lists the fields)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from diffjax.config import ConfigError, ModelConfig
from diffjax.kernels import reference


def standard_attention_flops(query_heads: int, head_dim: int, seq_len: int, causal: bool, backward: bool) -> float:
    """Standard attention over `query_heads` heads of `head_dim`: forward 4·H·N²·d (QKᵀ and PV), backward 2.5×."""
    units = 8.0 + (20.0 if backward else 0.0)  # in units of (H/2)·N²·d, as the DIFF counts (docs/design.md)
    return units * (query_heads / 2) * seq_len**2 * head_dim * (0.5 if causal else 1.0)


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    # Built `layer(cfg, name=...)`, called `(x, lambda_init, positions, segment_ids, decode)`; sows "qk" (rotated q,
    # k), "v", "heads" ([B, T, H, e], before any head norm), and where it has them "lambda" and "normed_heads"
    layer: type
    # "attention", "diff_attention", a tuple of both (each softmax map computed in an op from its q kᵀ/√d: its
    # `attention_logits`, which `quantization` quantizes), or None (attention in XLA: logits of its own, e.g. mixed)
    op: str | tuple[str, ...] | None
    # The effective [B, H, T, S] map from what it sowed and the mask [B, 1, T, S]; with `rows` [B, R], [B, H, R, S]
    attention_map: Callable[..., object]
    attention_flops: Callable[[ModelConfig, int, bool, bool], float] = (
        lambda cfg, n, causal, backward: standard_attention_flops(cfg.n_heads, cfg.head_dim, n, causal, backward))
    map_label: str = "A"  # what `attention_map` is, as figures title it (e.g. "A1 − λA2")
    # Its pre-softmax logits by softmax map, {name: [B, H, T, S] float32, NEG_INF where masked}, from what it sowed
    # and the mask: the one source of every reader of logits (telemetry, outliers, explore); default one map, q kᵀ/√d
    attention_logits: Callable[..., dict] = lambda cfg, sown, mask: pair_logits({"a": sown["qk"]}, mask)
    # Its effective map from its softmax maps ({name: [B, H, T, S]} as `attention_logits` names them) and what it
    # sowed, `rows` as in `attention_map` (`combined`); None: none declared
    combine: Callable[..., object] | None = None
    # (heads, head_dim) matched in parameters to DIFF's h heads of d (`matched_heads`); None: not matched, DIFF's kept
    match: Callable[[ModelConfig, int, int], tuple[int, int]] | None = lambda cfg, h, d: (h, d)
    headwise_norm: bool | None = False  # default of `model.headwise_norm=None`; None: the arch has no head norm
    layer_lambda: Callable | None = None  # (attn_params, λ_init) -> λ; None: no λ_init
    check: Callable[[ModelConfig], None] = lambda cfg: None  # arch-specific config checks (raise ConfigError)
    gates: tuple[str, ...] = ()  # the `model.gate` values it takes, its default first; () : no gate
    context_parallel: bool = False  # runs with the sequence split (`mesh.context` > 1)
    op_features: tuple[str, ...] = ()  # what its op's impl must support (kernels.FEATURES, e.g. "sinks")

    @property
    def has_lambda_init(self) -> bool:
        return self.layer_lambda is not None

    def combined(self, sown: dict, maps: dict, rows=None):
        """Its effective map from its softmax maps (`combine`; the one map of an "attention" op is what multiplies
        V); None where it declares none."""
        if self.combine is not None:
            return self.combine(sown, maps, rows)
        return next(iter(maps.values())) if self.ops == ("attention",) and len(maps) == 1 else None

    @property
    def ops(self) -> tuple[str, ...]:  # the kernel ops it calls (empty for op=None)
        return () if self.op is None else (self.op,) if isinstance(self.op, str) else self.op


_REGISTRY: dict[str, Arch] = {}


def take_rows(x, rows, axis: int = 1):
    """x's entries at the query positions `rows` [B, R] along `axis` (x is [B, ..., T, ...]); x where rows is None
    (a few rows of a long sequence's map cost O(R·S), not O(T·S))."""
    if rows is None:
        return x
    index = jnp.expand_dims(rows, tuple(range(1, axis)) + tuple(range(axis + 1, x.ndim)))
    return jnp.take_along_axis(x, index, axis=axis)


def row_probs(q_BTHd, k_BSKd, mask_B1TS, rows=None, sinks_H=None):
    """`reference.attention_probs` of the query rows `rows` [B, R] only ([B, H, R, S]); every row where None."""
    return reference.attention_probs(take_rows(q_BTHd, rows), k_BSKd, take_rows(mask_B1TS, rows, axis=2), sinks_H)


def pair_logits(pairs: dict[str, tuple], mask_B1TS) -> dict:
    """`Arch.attention_logits` of softmax maps whose logits are q kᵀ/√d: {name: logits} of {name: (q, k)}."""
    return {name: reference.attention_logits(q, k, mask_B1TS) for name, (q, k) in pairs.items()}


def register(arch: Arch) -> Arch:
    if not set(arch.ops) <= {"attention", "diff_attention"}:
        raise ValueError(f"arch {arch.name!r}: op must be 'attention', 'diff_attention', a tuple of them or None, "
                         f"got {arch.op!r}")
    _REGISTRY[arch.name] = arch
    return arch


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Arch:
    if name not in _REGISTRY:
        raise ConfigError(f"model.arch: unknown arch {name!r}; choose one of {names()}")
    return _REGISTRY[name]


def uses_headwise_norm(cfg: ModelConfig) -> bool:
    """`model.headwise_norm`, or the arch's default where it is None (never, where the arch has none)."""
    default = get(cfg.arch).headwise_norm
    return bool(default if cfg.headwise_norm is None or default is None else cfg.headwise_norm)


def gate(cfg: ModelConfig) -> str | None:
    """`model.gate`, or the arch's default where it is None (None for an arch without a gate)."""
    gates = get(cfg.arch).gates
    return cfg.gate if cfg.gate is not None else (gates[0] if gates else None)


def matched_shape(cfg: ModelConfig, h: int, d: int) -> tuple[int, int]:
    """(n_heads, head_dim) of `cfg.arch` matched in parameters to a DIFF model with h heads of d."""
    match = get(cfg.arch).match
    return (h, d) if match is None else match(cfg, h, d)


def matched_heads(h: int, d: int, ratio: float) -> tuple[int, int]:
    """(heads, head_dim) with heads·head_dim ≈ ratio·h·d: the shape matched to DIFF's h heads of d for an arch whose
    attention weights are d_model × (8 / ratio)·heads·head_dim (DIFF's: 8·d_model·h·d; a Transformer's four
    matrices: ratio 2, gated's five: 1.6); d kept where within 2 %, else the nearest even head_dim ≥ 8, fewest heads."""
    target, heads = ratio * h * d, max(1, round(ratio * h))
    if abs(heads * d - target) <= 0.02 * target:
        return heads, d
    candidates = [(n, dim) for n in range(h, max(2 * h, heads) + 1)
                  for dim in (2 * int(target / n / 2), 2 * int(target / n / 2) + 2) if dim >= 8]
    return min(candidates, key=lambda hd: (abs(hd[0] * hd[1] - target), hd[0]))


def check(cfg: ModelConfig) -> None:
    """The checks of `model.*` that need the architecture."""
    arch = get(cfg.arch)
    if cfg.gate is not None and cfg.gate not in arch.gates:
        if not arch.gates:
            gated = tuple(name for name, a in _REGISTRY.items() if a.gates)
            raise ConfigError(f"model.gate: arch {cfg.arch!r} has no gate (archs with one: {gated}); leave it unset")
        raise ConfigError(f"model.gate: unknown gate {cfg.gate!r} for arch {cfg.arch!r}; choose one of {arch.gates}")
    arch.check(cfg)  # first: an arch may count heads its own way (diff_v2's pairs and GQA groups)
    if cfg.kv_heads <= 0 or cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"model.n_kv_heads: {cfg.kv_heads} kv heads do not divide {cfg.n_heads} heads")
    if cfg.lambda_init is not None and not arch.has_lambda_init:
        raise ConfigError(f"model.lambda_init: arch {cfg.arch!r} has no λ_init")
    if cfg.headwise_norm and arch.headwise_norm is None:
        raise ConfigError(f"model.headwise_norm: {cfg.arch} has no headwise norm")


from diffjax.model.archs import diff, diff_v2, dint, gated, sink, transformer  # noqa: E402, F401  (registration)

"""One attention op, several implementations chosen by name (DESIGN §4).

    diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False)
      q1, q2: [B, T, H, d]  k1, k2: [B, S, K, d]  v: [B, S, K, 2d]  lam: float32 scalar -> [B, T, H, 2d]
    attention(q, k, v, *, causal=True, segment_ids=None, impl="auto", interpret=False)
      q: [B, T, H, d]  k: [B, S, K, d]  v: [B, S, K, e] -> [B, T, H, e]

Implementations register themselves with `register(name, attention=..., diff_attention=..., available=...)`.
"xla" (the pure-JAX reference in `reference.py`) is always available and is the oracle.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from diffjax.kernels import reference


@dataclasses.dataclass(frozen=True)
class Impl:
    attention: Callable | None
    diff_attention: Callable | None
    available: Callable[[], bool] = lambda: True  # noqa: E731  (is it usable on the default backend?)


_REGISTRY: dict[str, Impl] = {}
# "auto" tries these in order and takes the first that is available and implements the op.
AUTO_ORDER: list[str] = []


def register(name: str, *, attention=None, diff_attention=None, available=lambda: True, auto_rank=None):
    _REGISTRY[name] = Impl(attention, diff_attention, available)
    if auto_rank is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, name)


def names() -> list[str]:
    return ["auto", *_REGISTRY]


def resolve(impl: str, op: str) -> Callable:
    """The function implementing `op` ("attention" or "diff_attention") for `impl`."""
    if impl == "auto":
        for name in AUTO_ORDER:
            entry = _REGISTRY[name]
            if getattr(entry, op) is not None and entry.available():
                return getattr(entry, op)
        impl = "xla"
    if impl not in _REGISTRY:
        raise ValueError(f"unknown attention impl {impl!r}; known: {names()}")
    fn = getattr(_REGISTRY[impl], op)
    if fn is None:
        raise ValueError(f"attention impl {impl!r} does not implement {op}")
    if not _REGISTRY[impl].available():
        raise ValueError(f"attention impl {impl!r} is not available on backend {jax.default_backend()!r}")
    return fn


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False):
    fn = resolve(impl, "diff_attention")
    return fn(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids, interpret=interpret)


def attention(q, k, v, *, causal=True, segment_ids=None, impl="auto", interpret=False):
    fn = resolve(impl, "attention")
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, interpret=interpret)


register("xla", attention=reference.attention, diff_attention=reference.diff_attention)

"""What an attention implementation declares in its own module (`IMPL = Impl(...)`), and the one question the registry
asks it: can it run this `Call`? (`Impl.refuses`: None, or the reason it cannot; docs/design.md §4.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

FEATURES = ("sinks",)  # sinks: a per-head sink logit in `attention`'s softmax denominator (reference.attention_probs)


class Unsupported(ValueError):
    """An impl named for a call it refuses: its name and its reason."""


class Call(NamedTuple):
    """One op call as an impl is asked about it. `platform` None: not placed (a config check) or the impl's own code
    run on this host (Pallas interpret mode), so neither the platform nor `Impl.condition` is asked."""

    op: str  # "attention" or "diff_attention"
    platform: str | None = None
    dtype: object = None  # the inputs' dtype or its name; None: any
    features: tuple[str, ...] = ()
    split: bool = False  # one block of a sequence split over devices (context parallelism)


@dataclasses.dataclass(frozen=True)
class Impl:
    """An impl's op functions and what it runs. `blocks(interpret)`: its kernels on one block of a split sequence
    (fused_blocks.py; returning None: the reference per block); `condition(call)`: what else it needs where it runs,
    as the reason it refuses (this JAX's backends); `auto(call)`: whether "auto" may take it for a call it runs."""

    attention: Callable | None = None
    diff_attention: Callable | None = None
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")  # where it runs outside Pallas interpret mode
    dtypes: tuple[str, ...] | None = None  # the input dtypes it takes (None: any)
    features: tuple[str, ...] = ()  # the FEATURES its ops take
    blocks: Callable | None = None
    condition: Callable[[Call], str | None] = lambda call: None  # noqa: E731
    auto: Callable[[Call], bool] = lambda call: False  # noqa: E731  (named only)

    def __post_init__(self):
        if not set(self.features) <= set(FEATURES):
            raise ValueError(f"unknown features {self.features}; known: {FEATURES}")

    def refuses(self, call: Call) -> str | None:
        """Why it cannot run `call`, said after its name ("has no attention kernel with sinks"), or None."""
        dtype = call.dtype and jnp.dtype(call.dtype).name
        if getattr(self, call.op) is None:
            return f"has no {call.op} kernel"
        if not set(call.features) <= set(self.features):
            return f"has no {call.op} kernel with {', '.join(call.features)}"
        if call.split and self.blocks is None:
            return f"has no kernels for a block of a split sequence ({call.op})"
        if dtype and self.dtypes and dtype not in self.dtypes:
            return f"takes {' or '.join(self.dtypes)} inputs, not {dtype}"
        if call.platform and call.platform not in self.platforms:
            return f"does not run on {call.platform} (it runs on {', '.join(self.platforms)})"
        return self.condition(call) if call.platform else None

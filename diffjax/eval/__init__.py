"""Evaluation protocols by name (the paper's §3.3–3.8): each is a plain function usable from a notebook,

    result = eval.get("retrieval").run(cfg, params, **options)      # a JSON-able dict

and `diffjax eval --workdir RUN --protocol NAME` runs it on a run's latest checkpoint, writing
`RUN/eval/NAME.json`. Adding a protocol is one file in this package that builds a `Protocol` and calls
`register(...)`, plus its import at the bottom of this file (or anywhere before the CLI dispatches) and its tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from diffjax.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    run: Callable[..., dict]  # run(cfg, params, **options) -> a JSON-able dict
    applies: Callable[[Config], bool] = lambda cfg: True  # does it apply to a run's data? (`--protocol all`)


_REGISTRY: dict[str, Protocol] = {}


def register(protocol: Protocol) -> Protocol:
    _REGISTRY[protocol.name] = protocol
    return protocol


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Protocol:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown evaluation protocol {name!r}; choose one of {names()} or 'all'")
    return _REGISTRY[name]


def applicable(cfg: Config) -> list[Protocol]:
    """The protocols that apply to a run with config `cfg`, in registration order."""
    return [p for p in _REGISTRY.values() if p.applies(cfg)]


from diffjax.eval import retrieval, validation  # noqa: E402, F401  (registration)

"""Evaluation protocols by name (the paper's §3.3–3.8): each is a plain function usable from a notebook,

    result = eval.get("retrieval").run(cfg, params, **options)      # a JSON-able dict

and `diffjax eval --workdir RUN --protocol NAME [--set eval.option=value]` runs it on a run's latest checkpoint,
writing `RUN/eval/NAME.{json,md,png}`; `diffjax eval --compare RUN_A RUN_B --protocol NAME` puts two runs side by
side in one table and one figure.

Adding a protocol is one module in this package that builds a `Protocol` and calls `register(...)`; every module
here is imported when the package is, so nothing else needs editing (docs/design.md, "Extension points").
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import typing
from collections.abc import Callable
from pathlib import Path

from diffjax.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    run: Callable[..., dict]  # run(cfg, params, **options) -> a JSON-able dict
    applies: Callable[[Config], bool] = lambda cfg: True  # does it apply to a run's data? (`--protocol all`)
    # The paper-shaped Markdown table and figure of one or more runs: {label: result} (one label per run)
    markdown: Callable[[dict[str, dict]], str] | None = None
    plot: Callable[[dict[str, dict], object], None] | None = None  # (results, path of the PNG)

    def save_plot(self, results: dict[str, dict], path) -> Path:
        """Draw `plot(results)` to the PNG at `path`, creating its directory; the path written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.plot(results, path)
        return path

    def options(self) -> dict[str, object]:
        """The keyword options of `run` with their annotated types (what `--set eval.<option>=...` may set)."""
        hints = typing.get_type_hints(self.run)
        return {name: hints.get(name, str) for name, p in inspect.signature(self.run).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def parse_options(self, assignments: list[str]) -> dict:
        """`["eval.n=32", ...]` -> {"n": 32}, checked against `run`'s keyword options."""
        from diffjax.config import coerce

        known, out = self.options(), {}
        for assignment in assignments:
            key, sep, value = assignment.partition("=")
            name = key.strip().removeprefix("eval.")
            if not sep or not key.strip().startswith("eval.") or name not in known:
                raise ConfigError(f"protocol {self.name!r}: unknown option {assignment!r}; it takes "
                                  f"{', '.join(f'eval.{k}' for k in known) or 'no options'}")
            typ = known[name]
            out[name] = json.loads(value) if typ in (list, dict) else coerce(value.strip(), typ, f"eval.{name}")
        return out


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


DEFAULT = ("validation", "retrieval")  # `diffjax eval` without --protocol: the fast ones (those that apply)


def applicable(cfg: Config) -> list[Protocol]:
    """The protocols that apply to a run with config `cfg`, in registration order."""
    return [p for p in _REGISTRY.values() if p.applies(cfg)]


def _import_all() -> None:
    """Import every module of this package, so each protocol registers itself."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all()

"""Evaluation protocols by name (the paper's §3.3–3.8): `eval.get("retrieval").run(cfg, params, **options)` gives
a JSON-able dict; `diffjax eval` runs them on a run's checkpoint. Adding one: docs/design.md, "Extension points"."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
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

    def options(self) -> dict[str, object]:
        """The keyword options of `run` with their annotated types (what `--set eval.<option>=...` may set)."""
        hints = typing.get_type_hints(self.run)
        return {name: hints.get(name, str) for name, p in inspect.signature(self.run).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def save_plot(self, results: dict[str, dict], path) -> Path:
        """Draw `plot(results)` to the PNG at `path`, creating its directory; the path written."""
        from diffjax import paths

        path = paths.run_dir(path)
        paths.makedirs(path.parent)
        self.plot(results, path)  # through plotting.save, which writes local or remote paths
        return path

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


# This package's protocols, each by the name of its module (which registers it), with what it measures: plain data,
# so `diffjax --help` lists them without importing jax; the registry imports the modules when first asked.
PROTOCOLS = {
    "ar_hit": "validation loss on AR-Hit tokens and on the others (Table 6)",
    "attention_noise": "share of attention on the answer, context, question (Table 3)",
    "icl": "many-shot in-context classification (Figs. 6, 7)",
    "long_context": "cumulative NLL by position over long documents (Fig. 4)",
    "needle": "multi-needle retrieval accuracy (Table 2, Fig. 5)",
    "outliers": "the largest |attention logits| and |hidden states| (Table 5)",
    "position_loss": "validation loss by the tokens of its document seen",
    "quantization": "loss and retrieval with quantized attention logits (Fig. 8)",
    "retrieval": "exact retrieval accuracy by answer depth",
    "validation": "the training loop's validation loss and accuracies",
}

_REGISTRY: dict[str, Protocol] = {}


def register(protocol: Protocol) -> Protocol:
    _REGISTRY[protocol.name] = protocol
    return protocol


def _registry() -> dict[str, Protocol]:
    """Every protocol: this package's in PROTOCOLS' order, then any registered from elsewhere."""
    for name in PROTOCOLS:
        importlib.import_module(f"{__name__}.{name}")  # registers itself
    return {name: _REGISTRY[name] for name in PROTOCOLS} | _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(_registry())


def get(name: str) -> Protocol:
    if name not in _registry():
        raise ConfigError(f"unknown evaluation protocol {name!r}; choose one of {names()} or 'all'")
    return _REGISTRY[name]


DEFAULT = ("validation", "retrieval")  # `diffjax eval` without --protocol: the fast ones (those that apply)


def applicable(cfg: Config) -> list[Protocol]:
    """The protocols that apply to a run with config `cfg`, in `names()`' order."""
    return [p for p in _registry().values() if p.applies(cfg)]


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (the protocols' `markdown`)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


def progress(items, description: str, total: int | None = None):
    """`items`, with a transient progress bar on stderr where it is a terminal."""
    from rich.progress import track

    return track(items, description=description, total=total, disable=not sys.stderr.isatty(), transient=True)

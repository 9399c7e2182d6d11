"""Where a benchmark ran: the CPU model and library versions, recorded beside every figure."""

from __future__ import annotations

import importlib
import json
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(*modules: str) -> dict:
    """{"python": ..., module: module.__version__ for each named module}."""
    return {"python": platform.python_version()} | {m: importlib.import_module(m).__version__ for m in modules}


def emit(result: dict, json_path: str | Path | None,
         libraries: tuple[str, ...] = ("jax", "jaxlib", "flax", "optax", "numpy")) -> int:
    """Print `result` with the device and the libraries' versions as JSON, also to `json_path` if given; 0."""
    result = result | {"device": cpu_model(), "versions": versions(*libraries)}
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
    return 0

"""Execute the notebooks in place so the committed copies carry the outputs of a real run.

    python experiments/refresh_notebooks.py [--steps 800] [notebooks/x.ipynb ...]

Each notebook runs in `notebooks/` with `DIFFJAX_NOTEBOOK_STEPS=steps`, then is written back with its outputs and a
`diffjax` record (steps, versions, the SHA-256 of its code cells, which tests/test_notebooks.py checks).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from pathlib import Path

import nbformat
from benchlib import versions
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def code_sha256(nb) -> str:
    """The code cells' sources, hashed: what the stored outputs were computed from."""
    code = "\0".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    return hashlib.sha256(code.encode()).hexdigest()


# logged from C++ by `import jax` with the compile extra's CUDA plugin and no GPU: a user's install has no such plugin
PLUGIN_PROBE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
                          r"STDERR|I0000 .* cudart_stub\.cc:\d+\] Could not find cuda drivers.*)\n?", re.M)


def _without_plugin_probe(output):
    """`output` without the plugin probe's lines (None if nothing else is left)."""
    if output.output_type != "stream" or output.name != "stderr":
        return output
    output.text = PLUGIN_PROBE.sub("", output.text)
    return output if output.text.strip() else None


def refresh(path: Path, steps: int) -> None:
    nb = nbformat.read(path, as_version=4)
    os.environ["DIFFJAX_NOTEBOOK_STEPS"] = str(steps)  # the kernel inherits it
    NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   record_timing=False).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in map(_without_plugin_probe, cell.outputs) if o is not None]
    nb.metadata["diffjax"] = {"steps": steps, "code_sha256": code_sha256(nb),
                              "versions": versions("jax", "flax", "optax", "numpy", "matplotlib")}
    nbformat.write(nb, path)
    print(f"refreshed {path} ({steps} steps)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/")
    p.add_argument("--steps", type=int, default=800, help="training steps of the demo pair (the main job's)")
    args = p.parse_args(argv)
    for path in args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb")):
        refresh(path.resolve(), args.steps)
    return 0


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

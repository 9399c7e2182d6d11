"""The committed notebooks carry outputs computed from their current code (experiments/refresh_notebooks.py);
CI executes them afresh as well (nbmake, in the README's test command)."""

import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from refresh_notebooks import NOTEBOOKS, code_sha256  # noqa: E402


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_stored_outputs_come_from_the_current_code(path):
    nb = nbformat.read(path, as_version=4)
    record = nb.metadata.get("diffjax")
    assert record, f"{path.name} has no stored outputs: run `python experiments/refresh_notebooks.py {path}`"
    assert record["code_sha256"] == code_sha256(nb), \
        f"{path.name}'s code changed since its outputs were stored: run `python experiments/refresh_notebooks.py`"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert any(o.get("data", {}).get("image/png") for cell in code for o in cell.outputs), "no figure was stored"

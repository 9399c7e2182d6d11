"""The committed notebooks carry outputs computed from their current code (experiments/refresh_notebooks.py);
CI executes them afresh as well (nbmake, in the README's test command)."""

import importlib.util

import nbformat
import pytest
from helpers import REPO

# the refresh script, loaded from its file (experiments/ is scripts, not a package)
_spec = importlib.util.spec_from_file_location("refresh_notebooks", REPO / "experiments" / "refresh_notebooks.py")
refresh_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh_notebooks)
NOTEBOOKS, code_sha256 = refresh_notebooks.NOTEBOOKS, refresh_notebooks.code_sha256


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

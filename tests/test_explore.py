"""What the notebooks call: relative run paths mean the project's, whatever directory the kernel runs in."""

from diffjax import explore


def test_relative_run_paths_resolve_from_the_project_root(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for where in (tmp_path, tmp_path / "notebooks", tmp_path / "notebooks" / "deep"):
        where.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(where)
        assert explore.project_path("runs/main") == tmp_path.resolve() / "runs" / "main"
    assert explore.project_path(tmp_path / "elsewhere") == tmp_path / "elsewhere"  # absolute: kept

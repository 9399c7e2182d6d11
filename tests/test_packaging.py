"""A non-editable install runs the main job from any directory: the configs the CLI uses by default ship inside
the package (built here as a wheel from a copy of the project, unpacked outside the checkout)."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO, cli_env

from diffjax import cli
from diffjax import config as config_lib
from diffjax.config import ConfigError

pytestmark = pytest.mark.slow  # builds and installs the wheel


def test_the_wheel_ships_the_configs_and_runs_the_main_job_from_anywhere(tmp_path):
    """(The main job at one seed, two steps; `diffjax train` without --config names the same file, cli.MAIN_JOB,
    whose resolution from any directory the next test checks.)"""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "diffjax", source / "diffjax", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w",
                            str(tmp_path / "wheel")], capture_output=True, text=True)
    if built.returncode:
        pytest.skip(f"no wheel could be built here (pip needs setuptools from the index): {built.stderr[-300:]}")
    wheel = next((tmp_path / "wheel").glob("diffjax-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("diffjax/configs/")}
        z.extractall(tmp_path / "site")
    assert {f"diffjax/{c}" for c in config_lib.shipped_configs()} <= shipped
    assert "diffjax/configs/main.py" in shipped
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = cli_env() | {"PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-m", "diffjax.cli", "train", "--config", "configs/main.py:seeds=1,steps=2",
                          "--workdir", "job", "--no-progress", "--set", "train.eval_batches=1"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.startswith("main job (") and (elsewhere / "job" / "summary.json").is_file()
    assert "overriding" not in run.stderr  # Orbax's notice of diffjax's own handler choice
    where = subprocess.run([sys.executable, "-c", "import diffjax; print(diffjax.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(tmp_path / "site")), where.stdout  # the installed copy, not the checkout


def test_config_names_resolve_to_the_shipped_files_and_unknown_ones_list_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("configs/quickstart.py", "quickstart.py", "quickstart"):
        assert config_lib.find_config(spec) == config_lib.SHIPPED / "quickstart.py"
    assert config_lib.find_config(cli.MAIN_JOB) == config_lib.SHIPPED / "main.py"  # `diffjax train`, no --config
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.py").write_text("# a user's own file wins")
    assert config_lib.find_config("configs/quickstart.py").resolve() == tmp_path / "configs" / "quickstart.py"
    with pytest.raises(ConfigError, match=r"'configs/nope.py' not found \(shipped configs: configs/ablation.py, "):
        config_lib.load("configs/nope.py")

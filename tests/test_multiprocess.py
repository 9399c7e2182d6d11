"""Multi-process runs, for real: several `diffjax` processes on this machine joined by JAX's distributed runtime
(CPU devices, gloo collectives), each with one device or two fake ones, checked against single-process runs.

Synthetic data is sharded by example (process i reads examples i, i+n, …), so n processes see exactly the global
batches of one process, in another row order: losses agree to float32 summation order (RTOL).
"""

import json
import re
import signal
import socket
import subprocess

import jax
import numpy as np
import pytest
from helpers import MICRO, TINY, assert_redone_exactly, cli_env, diffjax, losses, sets

from diffjax import cli, paths
from diffjax import config as config_lib
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError
from diffjax.sweep.runner import run_sweep
from diffjax.train import faults
from diffjax.train.loop import train
from diffjax.train.run_loader import load_run

pytestmark = pytest.mark.slow  # every test here launches processes

RTOL = 2e-5
HEARTBEAT = 10  # seconds before the coordinator declares a silent process dead


def launch(command: list, tmp_path, name: str, *, devices: int = 1, extra=((), ()), env=({}, {})
           ) -> list[subprocess.Popen]:
    """Start `diffjax COMMAND` as two processes (process i adds `extra[i]` to its arguments, `env[i]` to its
    environment) meeting at a free local port; each logs to tmp_path/NAME.i.log."""
    port = free_port()
    return [diffjax(*command, *more, "--coordinator", f"127.0.0.1:{port}", "--num-processes", len(extra),
                    "--process-id", i, "--heartbeat-timeout", HEARTBEAT, env=cli_env(devices) | env[i],
                    log=open(tmp_path / f"{name}.{i}.log", "w"))  # noqa: SIM115 — the child holds it
            for i, more in enumerate(extra)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(procs, timeout: float = 120) -> list[int]:
    """Each process's exit status; a process still running after `timeout` fails the test, every one killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def log(tmp_path, name: str, i: int = 0) -> str:
    return (tmp_path / f"{name}.{i}.log").read_text()


def train_command(workdir, steps: int, *overrides) -> list:
    return ["train", "--config", TINY, "--workdir", workdir, "--no-progress",
            *sets([*MICRO, f"train.steps={steps}", *overrides])]


@pytest.mark.optimized  # its longest part: the evaluation protocols' passes over 16k tokens, in three processes
@pytest.mark.parametrize("devices,mesh", [(1, []), (2, ["mesh.data=1", "mesh.tensor=4"])],
                         ids=["2x1dev-data", "2x2dev-tensor"])
def test_processes_train_as_one_process_would(micro_run, tmp_path, devices, mesh):
    """Data parallel over the processes; or tensor parallel across them, where both read every batch row."""
    overrides = ["train.eval_every=3", "train.checkpoint_every=3"]
    micro_run(tmp_path / "one", "train.steps=6", *overrides)  # one process: trained once per test process
    procs = launch(train_command(tmp_path / "two", 6, *overrides, *mesh), tmp_path, "two", devices=devices)
    assert finish(procs) == [0, 0], log(tmp_path, "two") + log(tmp_path, "two", 1)
    for split in ("train", "val"):
        one, two = losses(tmp_path / "one", split), losses(tmp_path / "two", split)
        assert sorted(one) == sorted(two) and len(one) >= 2
        np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=RTOL)
    # one process cannot continue what two processes saved: each saved its own shard's data position
    with pytest.raises(ConfigError, match="written by 2 process"):
        train(config_lib.load(TINY, [*MICRO, "train.steps=6", *overrides, *mesh]), tmp_path / "two", progress=False)
    if devices == 1:  # evaluation under the launcher: every process evaluates all the data, process 0 writes
        protocols = ["validation", "ar_hit", "outliers", "quantization"]
        command = ["eval", "--workdir", tmp_path / "two", "--protocol", ",".join(protocols)]
        assert cli.main(list(map(str, command))) == 0  # this process alone
        alone = {p: json.loads((tmp_path / "two" / "eval" / f"{p}.json").read_text()) for p in protocols}
        assert finish(launch(command, tmp_path, "eval")) == [0, 0], log(tmp_path, "eval")
        for p in protocols:  # the numbers do not depend on the process count
            assert_close(json.loads((tmp_path / "two" / "eval" / f"{p}.json").read_text()), alone[p], p)
        assert alone["validation"]["loss"] == pytest.approx(losses(tmp_path / "one", "val")[6], rel=RTOL)


def assert_close(a, b, where: str) -> None:
    """Equal JSON trees, numbers to float32 summation order."""
    if isinstance(b, dict):
        assert sorted(a) == sorted(b), where
        for k in b:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6, nan_ok=True), where
    else:
        assert a == b, where


def test_a_killed_process_stops_the_others_and_a_relaunch_resumes_exactly(tmp_path):
    steps, every = 10, ["train.checkpoint_every=5"]
    # process 1 kills itself after step 9 (train/faults.py), its checkpoint at 5 complete
    victim = launch(train_command(tmp_path / "killed", steps, *every), tmp_path, "killed",
                    env=({}, {faults.ENV: "SIGKILL@9"}))
    assert victim[1].wait(timeout=300) == -signal.SIGKILL, log(tmp_path, "killed", 1)[-3000:]
    code = victim[0].wait(timeout=HEARTBEAT + 60)  # not a hang: the survivor ends with an error
    assert code != 0, log(tmp_path, "killed")
    # one line says why, the last it prints; no traceback (a collective that lost its peer is not a bug)
    survivor = log(tmp_path, "killed")
    assert "Traceback" not in survivor, survivor[-3000:]
    assert re.fullmatch(r"error in process 0 of 2: process\(es\) 1 of 2 stopped \(no heartbeat\); see their logs\. "
                        r"Relaunch every process to resume from the last checkpoint\.",
                        survivor.strip().splitlines()[-1]), survivor[-3000:]
    killed_at = max(losses(tmp_path / "killed"))  # what process 0 logged before the error
    assert 5 < killed_at < steps, killed_at
    resumed = launch(train_command(tmp_path / "killed", steps, *every), tmp_path, "resumed")
    assert finish(resumed) == [0, 0], log(tmp_path, "resumed")
    assert max(losses(tmp_path / "killed")) == steps
    assert_redone_exactly(tmp_path / "killed", at_least=killed_at - 6)  # 7…: a start logs from its second step


def test_a_signal_to_any_process_stops_all_at_one_step_and_a_relaunch_resumes_exactly(tmp_path, gcs):
    """SIGTERM / SIGINT to each process after different steps, or SIGTERM to one: every process stops after the same
    step, saves that one checkpoint and ends with one line; the relaunch (of the first) ends where an uninterrupted
    run does, bitwise (records, params and optimizer state). Each process signals itself (train/faults.py), so
    nothing races a timer; the step they stop at is the one they agree on, a step or two after the first signal.
    The second case's run directory is on gs:// (the `gcs` server; no process more): both processes write their
    shards of its checkpoint there, and its lease is the run's lock."""
    steps = 10
    cases = {"each": ({faults.ENV: "SIGTERM@3"}, {faults.ENV: "SIGINT@2"}), "one": ({}, {faults.ENV: "SIGTERM@3"})}
    dirs = {"each": tmp_path / "each", "one": gcs.url("one")}
    runs = {name: launch(train_command(dirs[name], steps), tmp_path, name, env=env) for name, env in cases.items()}
    runs["reference"] = launch(train_command(tmp_path / "reference", steps), tmp_path, "reference")
    codes = {name: finish(procs, timeout=300) for name, procs in runs.items()}  # a hang fails here
    assert codes == {"each": [130, 130], "one": [130, 130], "reference": [0, 0]}, codes
    for name in cases:
        lines = [log(tmp_path, name, i).strip().splitlines()[-1] for i in range(2)]
        stopped = re.fullmatch(r"interrupted: a SIGTERM or SIGINT to one of the 2 processes: all stopped at step "
                               r"(\d+); checkpoint saved, rerun every process to resume", lines[0])
        assert stopped and lines[1] == lines[0], lines
        assert 2 <= int(stopped[1]) < steps
        assert sorted(int(p.name) for p in (paths.run_dir(dirs[name]) / "checkpoints").iterdir()) == [int(stopped[1])]
    resumed = launch(train_command(tmp_path / "each", steps), tmp_path, "resumed")
    assert finish(resumed) == [0, 0], log(tmp_path, "resumed")
    # every step but the relaunch's first (a start logs from its second step), as the uninterrupted run logged it
    reference, again = losses(tmp_path / "reference"), losses(tmp_path / "each")
    assert again == {s: reference[s] for s in again} and len(again) == len(reference) - 1, (again, reference)
    state, reference = (load_run(tmp_path / name)[1] for name in ("each", "reference"))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state, reference)))


def test_a_slurm_launch_gives_each_task_its_share_of_the_node_and_a_mismatch_is_refused(tmp_path):
    """Two tasks of one SLURM node holding 4 GPUs, as srun starts them (JAX detects the job, `--distributed` not
    needed): each owns 2 devices and they train over all 4; a task that sees 1 is refused, on both, in one line."""
    def task(i: int, devices: int, port: int) -> dict:
        return cli_env(devices) | {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                                   "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NODEID": "0",
                                   "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4",
                                   "JAX_COORDINATOR_PORT": str(port)}

    runs = {}
    for name, devices in (("fits", 2), ("short", 1)):
        port = free_port()
        runs[name] = [diffjax(*train_command(tmp_path / name, 2), env=task(i, devices, port),
                              log=open(tmp_path / f"{name}.{i}.log", "w"))  # noqa: SIM115 — the child holds it
                      for i in range(2)]
    assert {name: finish(procs, timeout=300) for name, procs in runs.items()} == {"fits": [0, 0], "short": [2, 2]}
    for i in range(2):
        assert log(tmp_path, "short", i).strip().splitlines()[-1] == (
            "config error: process 0 of 2 sees 1 cpu device(s), but its launch (SLURM: task 0 of 2 on this node, "
            "SLURM_GPUS_ON_NODE=4) gives it 2; is jax installed for the GPU (pip install -e '.[cuda]')?")


def test_a_sweep_on_two_processes_gives_the_single_process_losses(tmp_path):
    sweep_file = tmp_path / "two_lrs.py"
    sweep_file.write_text("from diffjax import config\nfrom diffjax.sweep import Sweep, product\n\n\n"
                          "def get_sweep(arg=''):\n"
                          f"    return Sweep.build(config.load({TINY!r}), *product({{'optim.lr': [1e-3, 3e-3]}}), "
                          "seeds=2)\n")
    overrides = [*MICRO, "train.steps=4", "train.eval_every=4"]
    sweep = sweep_lib.load(str(sweep_file), overrides)
    run_sweep(sweep, tmp_path / "one", progress=False)
    procs = launch(["sweep", "--config", sweep_file, "--workdir", tmp_path / "two", "--no-progress",
                    *sets([*overrides, "sweep.devices=2"])],  # members split between the processes
                   tmp_path, "two")
    assert finish(procs) == [0, 0], log(tmp_path, "two") + log(tmp_path, "two", 1)
    assert len(sweep.members) == 4
    for member in sweep.members:
        for split in ("train", "val"):
            one = losses(tmp_path / "one" / "members" / member.name, split)
            two = losses(tmp_path / "two" / "members" / member.name, split)
            assert sorted(one) == sorted(two) and one, (member.name, split)
            np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=RTOL)


def test_processes_launched_with_different_configs_are_refused(tmp_path):
    procs = launch(train_command(tmp_path / "run", 4), tmp_path, "mismatch", extra=[[], ["--set", "optim.lr=0.002"]])
    assert finish(procs, timeout=60) == [2, 2]
    for i in range(2):
        assert re.search(r"process 1 was launched with a different config than process 0: optim\.lr "
                         r"\(0\.001 vs 0\.002\)", log(tmp_path, "mismatch", i)), log(tmp_path, "mismatch", i)


def test_incomplete_or_inconsistent_launch_flags_are_named(capsys):
    for flags, message in [(["--num-processes", "2", "--process-id", "0"], "missing --coordinator"),
                           (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
                            r"--process-id 2 must lie in \[0, --num-processes 2\)"),
                           (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
                            "must be HOST:PORT")]:
        assert cli.main(["train", "--config", TINY, *flags]) == 2
        assert re.search(message, capsys.readouterr().err)

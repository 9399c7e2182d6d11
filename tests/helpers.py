"""Shared by the training, sweep and multi-process tests: a very small config, run launching and reading."""

import collections
import os
import subprocess
import sys
from pathlib import Path

from diffjax.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
# A very small DIFF model on MQAR only (the retrieval task needs longer sequences), float32 for comparisons.
MICRO = ["model.d_model=32", "model.n_heads=1", "model.head_dim=16", "model.n_layers=2", "data.seq_len=64",
         "data.batch_size=8", "data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6",
         "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "optim.warmup_steps=2",
         "train.telemetry_every=0"]
TINY = "configs/small.py:size=tiny,arch=diff"


def losses(workdir, split: str = "train") -> dict[int, float]:
    """step -> loss of a run's records (the last record wins where a resumed run logged a step again)."""
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if r["split"] == split}


def cli_env(devices: int = 1) -> dict[str, str]:
    """The environment of a user's `diffjax` process: one CPU device (or `devices` fake ones)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def diffjax(*args, env=None, log=None) -> subprocess.Popen:
    """`python -m diffjax.cli ARGS` started from the repository root."""
    return subprocess.Popen([sys.executable, "-m", "diffjax.cli", *map(str, args)], cwd=REPO, env=env or cli_env(),
                            stdout=log, stderr=subprocess.STDOUT)


def sets(overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def assert_resumed_exactly(reference, resumed, killed_at: int, at_least: int) -> None:
    """The train losses a resumed run logged after its last pre-kill step equal the uninterrupted run's, bitwise
    (same batches, same state); at least `at_least` of them."""
    ref, res = losses(reference), losses(resumed)
    later = [s for s in ref if s > killed_at + 1]  # logged only by the resumed run
    assert len(later) >= at_least, (len(later), killed_at)
    assert [res[s] for s in later] == [ref[s] for s in later], resumed


def assert_redone_exactly(workdir, at_least: int) -> None:
    """The steps a killed run trained again after resuming from its last checkpoint (each logged twice: before the
    kill, after the resume) have the train losses they had before, bitwise: the checkpoint restored the state, the
    optimizer's moments and the data position. At least `at_least` of them. (Needs no uninterrupted reference run:
    `assert_resumed_exactly` compares with one.)"""
    logged = collections.defaultdict(list)
    for record in read_metrics(workdir):
        if record["split"] == "train":
            logged[record["step"]].append(record["loss"])
    redone = {step: values for step, values in logged.items() if len(values) > 1}
    assert len(redone) >= at_least and all(len(v) == 2 for v in redone.values()), (sorted(redone), workdir)
    before, after = ({step: values[i] for step, values in redone.items()} for i in (0, 1))
    assert after == before, workdir

"""Run directories on object storage, against a real server started here (fake-gcs-server, `conftest.gcs`): the lease
that replaces flock there (and on filesystems without flock), the one-line refusals, and a run killed and resumed on
gs:// ending bitwise where a local run does, then evaluated and exported from the bucket (docs/multihost.md, "Object
storage")."""

import errno
import fcntl
import json
import time

import jax
import numpy as np
import pytest
from helpers import MICRO, REPO, TINY, cli_env, diffjax, losses, sets

from diffjax import cli, paths
from diffjax.config import ConfigError
from diffjax.train import faults, workdir_lock
from diffjax.train.run_loader import load_run


def _no_flock(monkeypatch):
    def flock(f, op):  # what Lustre without `-o flock` answers
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", flock)


def _lease_checks(workdir):
    """One holder at a time; a released lease and one not renewed for LEASE_S are taken over (the next number)."""
    with workdir_lock.hold(workdir, "first"):
        with pytest.raises(ConfigError, match=r"is in use: first \(process \d+ on .*\) holds it, its lease renewed"):
            with workdir_lock.hold(workdir, "second"):
                pass
    leases = paths.run_dir(workdir) / workdir_lock.LEASES
    assert json.loads(paths.read_fresh(leases / "0"))["released"] is True
    dead = {"pid": 1, "host": "elsewhere", "command": "diffjax train", "since": "then",
            "renewed": time.time() - workdir_lock.LEASE_S - 1}  # killed: never released, not renewed since
    paths.create_exclusive(leases / "1", json.dumps(dead).encode())
    with workdir_lock.hold(workdir, "third"):
        assert paths.listing(leases) == ["0", "1", "2"]
    with pytest.raises(FileExistsError):  # the conditional create two contenders for lease 3 would race on
        paths.create_exclusive(leases / "2", b"{}")


def test_without_flock_a_run_directory_is_held_by_a_lease(tmp_path, monkeypatch):
    """Cost: no jax program, no process (< 0.1 s). Mutation: flock's ENOSYS re-raised (no fallback) fails it, as does
    `age < LEASE_S` dropped (the dead holder's lease would block)."""
    _no_flock(monkeypatch)
    _lease_checks(tmp_path / "run")
    assert not (tmp_path / "run" / workdir_lock.LOCK).read_text()  # the flock file was opened, then left empty


def test_on_gcs_a_run_directory_is_held_by_a_lease_made_by_a_conditional_create(gcs):
    """Cost: the server (once per test process, ~0.2 s) and a few requests. Mutation: `mode="create"` dropped from
    `paths.create_exclusive` (an unconditional upload) fails the FileExistsError check."""
    _lease_checks(gcs.url("lease"))


def test_urls_a_command_cannot_use_are_refused_in_one_line_and_nothing_is_written(gcs, tmp_path, monkeypatch, capsys):
    """A bucket that does not exist, an s3:// run, a data path and `prepare --out` on object storage: exit 2, one line
    each, no local `gs:` directory, no bucket made. Cost: no jax program (refused before training), < 1 s. Mutation:
    the `_check_urls` call in cli._run_handler removed lets train make `./gs:/…` and fail later."""
    monkeypatch.chdir(tmp_path)
    missing = "gs://no-such-bucket/run"
    cases = {
        ("train", "--config", TINY, "--workdir", missing, "--no-progress"):
            f"config error: {missing}: bucket 'no-such-bucket' does not exist (or these credentials cannot see it)",
        ("eval", "--workdir", missing): f"config error: {missing}: bucket 'no-such-bucket' does not exist (or these "
                                        f"credentials cannot see it)",
        ("train", "--config", TINY, "--workdir", "s3://bucket/run"):
            "config error: s3://bucket/run: Orbax, which writes the checkpoints, reaches gs:// buckets but not s3:// "
            "ones; use gs://, or a local or shared filesystem (synced to S3 with aws s3 sync)",
        ("prepare", "--path", ".", "--out", "gs://diffjax-test/shards"):
            "config error: --out gs://diffjax-test/shards: prepare reads and writes local files; copy to or from the "
            "bucket (gcloud storage cp -r, aws s3 cp --recursive) and give a local directory",
        ("train", "--config", TINY, "--workdir", gcs.url("run"), "--set", "data.source=shards", "--set",
         "data.path=gs://diffjax-test/shards"):
            "config error: data.path: gs://diffjax-test/shards: data is read from a local or shared filesystem; copy "
            "the shards there first (gcloud storage cp -r / aws s3 cp --recursive) and give that path",
    }
    for argv, line in cases.items():
        assert cli.main(list(argv)) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert list(tmp_path.iterdir()) == []
    gcs.fs.invalidate_cache()
    assert not gcs.fs.exists("no-such-bucket")


@pytest.mark.slow
def test_a_run_on_gcs_killed_resumes_bitwise_then_evaluates_and_exports_from_the_bucket(gcs, tmp_path):
    """Killed after step 3 (checkpoint 2 complete), the run on gs:// resumes from 2 and ends with the losses, params
    and optimizer state of the same command run uninterrupted on local disk, bitwise; `eval` and `hf export` read it
    from the bucket (`generate` too). Cost: 3 diffjax processes (~10 s each; the reference beside the killed run), an
    in-process eval, generate and export (~8 s). Mutations: `paths.refresh` in `run_config.read` removed (this process
    listed the checkpoints before the resume wrote step 4: load_run restores step 2), `writers.sync()` before a
    planned fault removed (no step-3 record reaches the bucket: the `max(losses) == 3` check) or the download of the
    old metrics.jsonl on resume removed (steps 2-3 lost) fails it."""
    url = gcs.url("run")
    args = ("train", "--config", TINY, "--no-progress", *sets([*MICRO, "train.steps=4", "train.checkpoint_every=2"]))
    tail = lambda: (tmp_path / "log.txt").read_text()[-3000:]  # noqa: E731
    with open(tmp_path / "log.txt", "w") as log:
        reference = diffjax(*args, "--workdir", tmp_path / "reference", log=log)
        assert diffjax(*args, "--workdir", url, env=cli_env() | {faults.ENV: "SIGKILL@3"}, log=log).wait(300) == -9
        assert max(losses(url)) == 3
        # listed last before the resume: this process's fsspec cache holds [2] until run_config.read refreshes it
        assert sorted(int(p.name) for p in (paths.run_dir(url) / "checkpoints").iterdir()) == [2]
        assert diffjax(*args, "--workdir", url, log=log).wait(timeout=300) == 0, tail()
        assert reference.wait(timeout=300) == 0, tail()
    state, ref = load_run(url)[1], load_run(tmp_path / "reference")[1]
    assert losses(url) == losses(tmp_path / "reference") and max(losses(url)) == 4
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state, ref)))
    print(f"{url}: {gcs.stored_bytes(url)} bytes stored; final loss {losses(url)[4]!r} (uninterrupted local run: "
          f"{losses(tmp_path / 'reference')[4]!r})")
    assert cli.main(["eval", "--workdir", url, "--protocol", "validation"]) == 0
    assert json.loads((paths.run_dir(url) / "eval" / "validation.json").read_text())["step"] == 4
    assert cli.main(["generate", "--workdir", url, "--prompt", "a", "--max-new-tokens", "2"]) == 0
    assert cli.main(["hf", "export", "--workdir", url, "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert not (REPO / "gs:").exists()


@pytest.mark.slow
def test_a_sweep_on_gcs_trains_its_members_and_reports_there(gcs, tmp_path, monkeypatch, capsys):
    """`diffjax sweep --workdir gs://…` (in process): every member's run directory, the sweep's state and its report
    in the bucket, and `--report` rebuilds it from there. Cost: 2 members × 4 steps stacked, one program (~10 s).
    Mutation: `paths.run_dir` in `sweep/runner.py::run_sweep` back to `Path` fails it (a local `gs:` directory)."""
    sweep_file = tmp_path / "two_lrs.py"
    sweep_file.write_text("from diffjax import config\nfrom diffjax.sweep import Sweep, product\n\n\n"
                          "def get_sweep(arg=''):\n"
                          f"    return Sweep.build(config.load({TINY!r}), *product({{'optim.lr': [1e-3, 3e-3]}}), "
                          "seeds=1)\n")
    url = gcs.url("sweep")
    monkeypatch.chdir(tmp_path)  # where a URL taken for a local path would make `gs:/…`
    argv = ["sweep", "--config", str(sweep_file), "--workdir", url, "--no-progress",
            *sets([*MICRO, "train.steps=4", "train.eval_every=4"])]
    assert cli.main(argv) == 0
    members = sorted(p.name for p in (paths.run_dir(url) / "members").iterdir())
    assert len(members) == 2 and all(max(losses(f"{url}/members/{m}")) == 4 for m in members)
    report = (paths.run_dir(url) / "results.md").read_text()
    assert all(m in report for m in members) and (paths.run_dir(url) / "results.png").exists()
    capsys.readouterr()
    assert cli.main(["sweep", "--report", url]) == 0
    assert capsys.readouterr().out.startswith(report)
    assert not (tmp_path / "gs:").exists()

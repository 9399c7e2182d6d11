"""A run is never destroyed: a resume with a trajectory-changing config is refused (naming every changed field)
and touches nothing; an allowed change is recorded as a new segment; an evaluation never writes into
`checkpoints/`; a checkpoint of another state is an error, not damage; one live writer per workdir."""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import MICRO, REPO, TINY, assert_redone_exactly, cli_env, losses, sets
from test_hf import trained_diff
from test_hf_cli import CFG

from diffjax import cli
from diffjax import config as config_lib
from diffjax.config import ROPE_SCALINGS, ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.hf.run import import_run
from diffjax.sweep.runner import run_sweep
from diffjax.sweep.spec import Sweep
from diffjax.train import faults, run_config
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics
from diffjax.train.run_loader import load_run


def _config(*overrides, steps):
    return config_lib.load(TINY, MICRO + [f"train.steps={steps}", "train.checkpoint_every=2", *overrides])


def _trained(micro_run, workdir, *, steps):
    """`workdir` holding the finished run of `_config(steps=steps)`: trained once per test process, copied here."""
    return micro_run(workdir, f"train.steps={steps}", "train.checkpoint_every=2")


def _listing(workdir):
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if "tensorboard" not in p.parts)


def _garble(step_dir):
    for file in step_dir.rglob("*"):
        if file.is_file():
            file.write_bytes(b"\0garbage")


def test_a_changed_config_is_refused_and_nothing_is_touched(micro_run, tmp_path, capsys):
    _trained(micro_run, tmp_path, steps=4)
    before, config_json = _listing(tmp_path), (tmp_path / "config.json").read_text()
    code = cli.main(["train", "--config", TINY, *sum((["--set", s] for s in MICRO), []), "--workdir", str(tmp_path),
                     "--set", "train.steps=8", "--set", "train.checkpoint_every=2", "--set", "optim.clip_norm=0",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "optim.clip_norm: 1.0 in the run, 0.0 now" in err and "train.steps: 4 in the run, 8 now" in err
    assert "--allow-config-change" in err
    assert _listing(tmp_path) == before and (tmp_path / "config.json").read_text() == config_json


def test_cadence_telemetry_and_mesh_may_change_freely(micro_run, tmp_path):
    _trained(micro_run, tmp_path, steps=4)
    out = train(_config("train.log_every=1", "mesh.data=2", "train.telemetry_every=2", steps=4), tmp_path,
                progress=False)
    assert out.start_step == 4 and "segments" not in json.loads((tmp_path / "config.json").read_text())


def test_an_allowed_change_continues_records_its_segment_and_its_optimizer_numbers_take_effect(micro_run, tmp_path,
                                                                                               rng):
    """A finished 4-step run resumed to 8 steps with new, random optimizer numbers (`--allow-config-change`):
    it continues from step 4 and records the change as a new segment (config.json stays readable as a config); the lr
    logged after the resume follows the new schedule (peak and final lr over the new length), and the saved optimizer
    state holds every new number, not the ones it was restored with."""
    _trained(micro_run, tmp_path, steps=4)
    lr = float(10 ** rng.uniform(-5, -3.5))
    new = {"lr": lr, "final_lr": lr * float(rng.uniform(0.01, 0.5)), "b1": float(rng.uniform(0.5, 0.85)),
           "b2": float(rng.uniform(0.9, 0.99)), "eps": float(10 ** rng.uniform(-7, -5)),
           "weight_decay": float(rng.uniform(0.2, 0.5)), "clip_norm": float(rng.uniform(2, 5))}
    cfg = _config(*(f"optim.{k}={v!r}" for k, v in new.items()), steps=8)
    out = train(cfg, tmp_path, progress=False, allow_config_change=True)
    assert (out.start_step, out.step) == (4, 8)
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["train"]["steps"] == 8
    assert [(s["from_step"], s["config"]["train"]["steps"]) for s in record["segments"]] == [(0, 4), (4, 8)]
    run_cfg, state, _ = load_run(tmp_path)
    assert run_cfg.train.steps == 8  # config.json stays readable as a config
    warmup, last = cfg.optim.warmup_steps, 8 - 1  # the decay reaches final_lr at the last update
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path) if r["split"] == "train" and r["step"] > 4}
    assert sorted(logged) == [6, 7, 8]  # a segment's first step (its compilation) is not logged
    for step, value in logged.items():  # step s logs update s − 1
        expected = new["lr"] + (new["final_lr"] - new["lr"]) * (step - 1 - warmup) / (last - warmup)
        assert value == pytest.approx(expected, rel=1e-5), (step, value, expected)
    names = {"lr": "peak_lr", "clip_norm": "max_norm"}
    for field, value in new.items():
        assert float(optax.tree_utils.tree_get(state.opt_state, names.get(field, field))) == \
            pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize("change, why", [("train.seed=3", "it drew the initial parameters"),
                                         ("model.n_layers=3", "it shapes the saved parameters"),
                                         ("optim.clip_norm=0", "it shapes the saved optimizer state"),
                                         ("model.lambda_ramp_steps=3", "it shapes the saved parameters")])
def test_what_a_resume_cannot_change_is_refused_by_name(micro_run, tmp_path, change, why):
    """`--allow-config-change` lets every change through but these: each refused naming the field and why, before
    anything is written."""
    _trained(micro_run, tmp_path, steps=4)
    before = _listing(tmp_path), (tmp_path / "config.json").read_text()
    field = change.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"cannot change, even with --allow-config-change:\n  {field}: .*{why}"):
        train(_config(change, steps=6), tmp_path, progress=False, allow_config_change=True)
    assert (_listing(tmp_path), (tmp_path / "config.json").read_text()) == before


ROPE = ["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
        "model.rope_high_freq_factor=4", "model.rope_original_max_positions=64"]
# Each field's change to put to the rule where doubling its value, negating or extending it does not reach what the
# field fixes: (the run's settings beside MICRO's, the new value; None: the run's value doubled).
CHANGES = {"model.arch": ([], "dint"),  # diff's shapes: refused as `fixed` (config.setting), by no shape
           "model.n_kv_heads": (["model.n_heads=2"], 1), "model.ffn_dim": ([], 64), "model.lambda_init": ([], 0.5),
           "model.headwise_norm": ([], False), "model.gate": (["model.arch=gated"], "elementwise"),
           "model.rope_scaling": (ROPE, "linear"), **{f"model.{f}": (ROPE, None) for f in ROPE_SCALINGS["llama3"]},
           "model.dtype": ([], "bfloat16"), "data.path": ([], "corpus.txt"), "data.task_weights": ([], (1.0,)),
           "optim.clip_norm": ([], 0.0)}


def _refused(key: str) -> bool:
    """Whether a resume with --allow-config-change refuses `key`'s change (`CHANGES`, else its value doubled, negated
    or extended: 0 → 1, "byte" → "byteb")."""
    base, value = CHANGES.get(key, ([], None))
    run = config_lib.load(TINY, [*MICRO, "model.n_layers=1", *base])  # one layer: tracing it is the cost
    old = run_config._flat(run)[key]
    if value is None:
        value = not old if isinstance(old, bool) else old * 2 or 1 if isinstance(old, int | float) else old + old[:1]
    assert value != old, key
    return any(line.startswith(f"{key}:") for line in
               run_config.fixed_changes(run, config_lib.replace_field(run, key, value)))


def test_the_allowed_change_table_is_the_rule():
    """docs/training.md's table of what a resume may change has one row per config field; the rows it marks free
    are the fields marked `free` (`config.setting`), and those it marks refused are exactly the fields whose change
    the rule refuses (`run_config.fixed_changes`: a change of the saved state's structure, computed, or a field
    marked `fixed`)."""
    text = (REPO / "docs" / "training.md").read_text()
    table = text[text.index("| field | at a resume"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        names, effect = line.split("|")[1:3]
        for name in re.findall(r"`([a-z_]+(?:\.[a-z0-9_*]+)?)`", names):
            rows[name] = effect.strip()
    fields = set(run_config._flat(config_lib.Config()))
    effect = {f: rows.get(f) or rows.get(f"{f.split('.')[0]}.*") or rows.get(f.split(".")[0]) for f in fields}
    assert None not in effect.values(), sorted(f for f, e in effect.items() if e is None)
    free = config_lib.fields_where("free")
    assert {f for f, e in effect.items() if e.startswith("free")} == fields & set(free)
    refused = {f for f in fields if f not in free and _refused(f)}
    assert refused == {f for f, e in effect.items() if e.startswith("refused")}


def test_a_resume_follows_the_rule_on_each_field(rng):
    """What a resume asks of each field is the rule on it (`config.setting`): a change of a `free` field passes
    without --allow-config-change; of a `fixed` one is refused even with it, by its reason, the reasons as they have
    always read (an import, a step 0, sets what drew the initial parameters); of any other needs the flag."""
    drew = "it drew the initial parameters, at step 0"
    assert config_lib.fields_where("fixed") == {
        "model.arch": "another arch reads the same arrays as other weights: diff's and dint's have the same shapes",
        "model.init_std": drew, "data.tokenizer": "the embedding's rows are this tokenizer's tokens",
        "train.seed": drew}
    run = config_lib.load(TINY, MICRO)
    free, fixed = config_lib.fields_where("free"), config_lib.fields_where("fixed")
    for key, old in run_config._flat(run).items():  # each changed alone, to a fresh value of its type
        bump = int(rng.integers(1, 100))
        value = ("1" if old is None else not old if isinstance(old, bool) else
                 old + bump if isinstance(old, int | float) else f"{old}{bump}" if isinstance(old, str) else
                 old + ((old or ("1",))[0],))
        new = config_lib.replace_field(run, key, value)
        assert bool(run_config.changed_fields(run, new)) == (key not in free), key
        if key in fixed:
            line = f"{key}: {old!r} in the run, {run_config._flat(new)[key]!r} now ({fixed[key]})"
            assert run_config.fixed_changes(run, new) == [line]
            assert run_config.fixed_changes(run, new, at_step_0=True) == ([] if fixed[key] == drew else [line])


@dataclasses.dataclass(frozen=True)
class _WithFfnMultiple(config_lib.ModelConfig):
    """ModelConfig with a new field, with no rule on it (`config.setting`), that shapes the parameters: the multiple
    the feed-forward width rounds up to."""
    ffn_multiple: int = 128

    @property
    def resolved_ffn_dim(self) -> int:
        return self.ffn_multiple * math.ceil(8 * self.d_model / 3 / self.ffn_multiple)


def test_a_new_field_that_shapes_the_parameters_is_fixed_though_no_list_names_it():
    run = config_lib.load(TINY, MICRO)
    old = dataclasses.replace(run, model=_WithFfnMultiple(**dataclasses.asdict(run.model)))
    new = config_lib.replace_field(old, "model.ffn_multiple", 32)  # d_model 32: the FFN 128 wide, then 96
    assert run_config.fixed_changes(old, new) == [
        "model.ffn_multiple: 128 in the run, 32 now (it shapes the saved parameters)"]
    assert run_config.fixed_changes(old, new, was="in the checkpoint", at_step_0=True) == [
        "model.ffn_multiple: 128 in the checkpoint, 32 now (it shapes the saved parameters)"]


RUN_V1 = REPO / "tests" / "fixtures" / "run_v1" / "run"  # tests/fixtures/run_v1/make_fixture.py


def test_a_run_of_format_1_resumes_to_the_records_it_logged(tmp_path):
    """The committed run directory of run format 1, as a kill left it (metrics of steps 2-8 logged, the last
    checkpoint step 4's), resumed by today's code, trains steps 5-8 again to the train losses its uninterrupted run
    logged: config.json, the checkpoint's parameters, optimizer state and data position all read as they were
    written (a drift of XLA's numbers aside, which is far smaller than a lost state's)."""
    run = shutil.copytree(RUN_V1, tmp_path / "run")
    out = train(run_config.load(run), run, progress=False)
    assert (out.start_step, out.step) == (4, 8)
    logged = {}
    for record in read_metrics(run):
        if record["split"] == "train":
            logged.setdefault(record["step"], []).append(record["loss"])
    redone = {step: values for step, values in logged.items() if len(values) == 2}
    assert sorted(redone) == [6, 7, 8]  # step 5 compiles the step, unlogged
    for step, (before, after) in redone.items():
        assert after == pytest.approx(before, rel=1e-5), step
    assert json.loads((run / "config.json").read_text())["run_format"] == run_config.RUN_FORMAT


@pytest.mark.parametrize("found", [None, run_config.RUN_FORMAT + 1])
def test_a_run_without_a_format_reads_as_format_1_and_a_newer_one_is_refused(tmp_path, capsys, found):
    """A config.json written before runs recorded their format is format 1; a run of a newer format than this code
    reads stops `diffjax train` and `eval` at once with one line naming both formats (exit 2), nothing written."""
    run = shutil.copytree(RUN_V1, tmp_path / "run")
    cfg, record = run_config.load(run), json.loads((run / "config.json").read_text())
    del record["run_format"]
    (run / "config.json").write_text(json.dumps(record | ({"run_format": found} if found else {})))
    if found is None:
        assert run_config.load(run) == cfg
        return
    before = _listing(run), (run / "config.json").read_text()
    for command in (["train", "--workdir", str(run)], ["eval", "--workdir", str(run)]):
        assert cli.main(command) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            f"{run / 'config.json'}: run format {found}; this diffjax reads format {run_config.RUN_FORMAT} (a newer "
            f"diffjax wrote the run: update diffjax)")
    assert (_listing(run), (run / "config.json").read_text()) == before


def test_a_run_made_with_relative_paths_works_from_any_directory_and_moved(tmp_path, monkeypatch, capsys, rng):
    """Runs made as the docs type their paths (`--workdir runs/r`, `data.path=corpus.txt`): config.json records the
    data absolutely (relative to the run where it lies inside it) and the run's own directory as train.workdir, so
    `diffjax eval` works from another directory, and a run moved with its data inside; data that is gone is one
    line naming data.path and what to set, and setting it gives the same loss."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    (home / "runs" / "inside").mkdir(parents=True)
    elsewhere.mkdir()
    words = ["the", "cat", "sees", "a", "dog", "under", "some", "tree", "today"]
    text = "\n\n".join(" ".join(rng.choice(words, 12)) for _ in range(60))
    for corpus in (home / "corpus.txt", home / "runs" / "inside" / "corpus.txt"):
        corpus.write_text(text)
    monkeypatch.chdir(home)
    data = ["data.source=text", "data.seq_len=32", "train.eval_batches=1"]
    for run, path in (("runs/r", "corpus.txt"), ("runs/inside", "runs/inside/corpus.txt")):
        import_run(None, run, [*data, f"data.path={path}"], model_cfg=CFG, params=trained_diff(CFG))
    records = {r: json.loads((home / "runs" / r / "config.json").read_text()) for r in ("r", "inside")}
    assert records["r"]["data"]["path"] == str((home / "corpus.txt").resolve())
    assert records["inside"]["data"]["path"] == "corpus.txt"
    assert records["r"]["train"]["workdir"] == str((home / "runs" / "r").resolve())

    def val_loss(workdir, *sets_) -> float:
        capsys.readouterr()
        assert cli.main(["eval", "--workdir", workdir, "--protocol", "validation", "--json", *sets_]) == 0
        return json.loads(capsys.readouterr().out)["validation"]["loss"]

    monkeypatch.chdir(elsewhere)
    before = val_loss("../home/runs/r")
    shutil.move(home / "runs" / "inside", tmp_path / "moved")
    assert val_loss("../moved") == before  # the same data and parameters
    (home / "corpus.txt").rename(tmp_path / "corpus-moved.txt")
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", "../home/runs/r", "--protocol", "validation"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"data error: data.path {(home / 'corpus.txt').resolve()}: no such file or directory; set data.path to where "
        f"the data is now")
    assert val_loss("../home/runs/r", "--set", "data.path=../corpus-moved.txt") == before


@pytest.mark.parametrize("change", ["source", "seq_len"])
def test_a_changed_data_stream_starts_from_its_beginning_and_says_so(micro_run, tmp_path, change, caplog):
    """A saved data position belongs to its stream: under another source it would not restore (grain raises), under
    another sequence length it would silently skip data. Either way the new data starts afresh, recorded."""
    _trained(micro_run, tmp_path, steps=4)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}: " + "some words of text " * (3 + i % 7) for i in range(200)))
    new = {"source": ["data.source=text", f"data.path={corpus}"], "seq_len": ["data.seq_len=32"]}[change]
    cfg = _config(*new, steps=8)
    out = train(cfg, tmp_path, progress=False, allow_config_change=True)
    assert (out.start_step, out.step) == (4, 8)
    notice = json.loads((tmp_path / "config.json").read_text())["segments"][-1]["data_restarted"]
    assert notice.startswith(f"data.{change}") and "starts from its beginning" in notice
    assert notice in caplog.text
    fresh = make_iterator(cfg.data, split="train", process_index=0, process_count=1)
    for _ in range(4):  # the four steps trained since the change
        next(fresh)
    ckpt = Checkpointer(tmp_path / "checkpoints", 3, read_only=True)
    try:
        saved = ckpt.manager.restore(8, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    finally:
        ckpt.close()
    assert saved["processes"][0] == json.loads(json.dumps(fresh.get_state()))


def test_evaluation_never_writes_into_checkpoints(micro_run, tmp_path):
    _trained(micro_run, tmp_path, steps=4)
    _garble(tmp_path / "checkpoints" / "4")
    before = _listing(tmp_path)
    with pytest.warns(UserWarning, match="checkpoint step 4 .* unreadable .*left in place"):
        _, state, _ = load_run(tmp_path)
    assert int(state.step) == 2 and _listing(tmp_path) == before
    _garble(tmp_path / "checkpoints" / "2")
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="holds no readable checkpoint"):
        load_run(tmp_path)
    assert _listing(tmp_path) == before


def test_every_reader_and_training_fall_back_from_a_damaged_step_and_only_training_moves_it(
        micro_run, tmp_path, monkeypatch, capsys):
    """The newest checkpoint damaged: `diffjax eval`, `generate` and `hf export` each warn and read the step before
    it, leaving the run's files as they were, and training's resume falls back too (moving the step aside): all
    through `Checkpointer.restore_latest`, the one fallback (`train/run_loader.py` for the readers)."""
    run = _trained(micro_run, tmp_path / "run", steps=4)
    _garble(run / "checkpoints" / "4")
    restores = []  # (read-only?, the step restored) of each restore

    def spied(self, *args, **kwargs):
        restored = restore_latest(self, *args, **kwargs)
        restores.append((self.read_only, restored[0]))
        return restored

    restore_latest = Checkpointer.restore_latest
    monkeypatch.setattr(Checkpointer, "restore_latest", spied)
    files = lambda: [p for p in _listing(run) if not p.startswith("eval")]  # noqa: E731 — eval writes its results
    before = files()
    for reader in (["eval", "--workdir", str(run), "--protocol", "validation"],
                   ["generate", "--workdir", str(run), "--prompt", "ab", "--max-new-tokens", "2"],
                   ["hf", "export", "--workdir", str(run), "--out", str(tmp_path / "hf")]):
        with pytest.warns(UserWarning, match="checkpoint step 4 .* unreadable .*left in place"):
            assert cli.main(reader) == 0, capsys.readouterr().err
        assert restores.pop() == (True, 2) and not restores and files() == before, reader[0]
    with pytest.warns(UserWarning, match="checkpoint step 4 .* unreadable .*moved to"):
        assert train(_config(steps=4), run, progress=False).start_step == 2
    assert restores == [(False, 2)]
    (kept,) = (run / "unreadable_checkpoints").iterdir()  # whole, so the resumed run saved step 4 anew
    assert kept.name.startswith("4-") and any(kept.rglob("*"))


def test_a_checkpoint_of_another_state_is_an_error_not_damage(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    ckpt.save(1, {"w": jnp.zeros((3, 4))}, {"position": 0})
    ckpt.close()
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    with pytest.raises(ConfigError, match=r"different train state .*\(3, 4\)"):
        ckpt.restore_latest({"w": jax.ShapeDtypeStruct((5, 4), jnp.float32)})
    assert ckpt.manager.all_steps() == [1] and not (tmp_path.parent / "unreadable_checkpoints").exists()


def test_a_workdir_held_by_a_live_run_is_refused_and_a_dead_ones_is_not(tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom diffjax.train import workdir_lock\n"
         f"with workdir_lock.hold(Path({str(tmp_path)!r}), 'diffjax sweep'):\n    print('held', flush=True)\n"
         "    time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["train", "--config", TINY, *sum((["--set", s] for s in MICRO), []), "--workdir", str(tmp_path),
                "--set", "train.steps=4", "--no-progress"]  # the program of `_trained(steps=4)`
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert f"is in use: diffjax sweep (process {holder.pid} on" in err, err
        assert not (tmp_path / "config.json").exists()
        with pytest.raises(ConfigError, match=f"process {holder.pid}"):
            run_sweep(Sweep.build(_config(steps=4)), tmp_path, progress=False)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
        holder.wait()
    assert cli.main(args) == 0 and (tmp_path / "config.json").exists()


def _stopped_at(monkeypatch, step: int, cfg, workdir) -> None:
    """Train `cfg` in `workdir` in this process until it stops itself after `step` (SIGTERM from the `faults` hook; a
    run's handler saves and returns): the stopped run that the test's processes then resume, made without a process
    of its own. (Its steps are not compared: each test compares the steps its processes train.)"""
    with monkeypatch.context() as m:
        m.setenv(faults.ENV, f"SIGTERM@{step}")
        out = train(cfg, workdir, progress=False)
    assert out.interrupted and out.step == step, out.interrupted


def _user_stderr(*args, env=None) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `diffjax ARGS` as a user's shell runs it: JAX_PLATFORMS unset, so the CLI picks
    the CPU itself with the accelerator plugins (the compile extra, installed for the tests) present; `env`: more
    variables."""
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"} | (env or {})
    out = subprocess.run([sys.executable, "-m", "diffjax.cli", *map(str, args)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stderr.splitlines()


def test_refused_evaluations_and_restores_print_one_line_not_library_tracebacks(micro_run, tmp_path):
    """A key that changes what the checkpoint is, refused before anything loads, and a resume whose allowed
    config change would give the checkpoint another shape (refused by name before anything loads; the restore of
    another state is refused from the metadata too: `test_a_checkpoint_of_another_state_is_an_error_not_damage`):
    each exits 2 with its message, the only lines on stderr."""
    _trained(micro_run, tmp_path, steps=4)
    code, err = _user_stderr("eval", "--workdir", tmp_path, "--set", "model.d_model=7", "--protocol", "validation")
    assert code == 2 and len(err) <= 3, err
    assert err[-1].startswith("config error: --set model.d_model=7: model.d_model is part of what the checkpoint is")
    code, err = _user_stderr("train", "--config", TINY, *sets(MICRO), "--set", "train.steps=8", "--set",
                             "train.checkpoint_every=2", "--set", "model.d_model=48", "--workdir", tmp_path,
                             "--allow-config-change", "--no-progress")
    assert code == 2 and len(err) == 3, err
    assert err[0].endswith("config.json: a resume cannot change, even with --allow-config-change:"), err
    assert err[1].strip() == "model.d_model: 32 in the run, 48 now (it shapes the saved parameters)", err


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (mounting needs root, as CI and the development machines have)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", disk], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", disk], check=True)


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_a_rerun_resumes_exactly(small_disk, monkeypatch):
    """The disk fills between two checkpoints: the run stops with one line naming the directory, the cause and the
    last complete checkpoint (no traceback, no Orbax thread reports); that checkpoint restores, and the rerun trains
    the lost steps again exactly as they went before."""
    workdir = small_disk / "run"
    args = ["train", "--config", TINY, *sets(MICRO), "--set", "train.steps=8", "--set", "train.checkpoint_every=2",
            "--workdir", workdir, "--no-progress"]
    _stopped_at(monkeypatch, 4, _config(steps=8), workdir)
    free = shutil.disk_usage(small_disk).free
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (free - 300 * 1024))  # room for metrics, not for the next checkpoint (~850 KB)
    code, err = _user_stderr(*args)
    assert code == 1 and len(err) <= 3, err
    assert err[-1] == (f"error: {workdir / 'checkpoints'}: checkpoint step 6 could not be written: No space left on "
                       f"device; the last complete checkpoint: step 4 (make room, then rerun the same command to "
                       f"resume from it)"), err
    ballast.unlink()
    code, err = _user_stderr(*args)
    assert code == 0, err
    assert_redone_exactly(workdir, at_least=2)
    assert max(losses(workdir)) == 8


def test_eval_records_the_overrides_it_ran_under(micro_run, tmp_path, capsys):
    _trained(micro_run, tmp_path, steps=4)
    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "validation", "--set", "data.seed=9",
                     "--set", "train.eval_batches=2"]) == 0
    record = json.loads((tmp_path / "eval" / "validation.json").read_text())
    assert record["overrides"] == ["data.seed=9", "train.eval_batches=2"]
    for key in ("optim.lr=1", "train.steps=9", "model.n_layers=3"):
        assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "validation", "--set", key]) == 2
        assert "is part of what the checkpoint is" in capsys.readouterr().err


def _remount(disk, mode: str) -> None:
    """Remount `disk` read-only ("ro") or writable ("rw"): as root, a read-only mount is what refuses writes."""
    if subprocess.run(["mount", "-o", f"remount,{mode}", disk], capture_output=True).returncode:
        pytest.skip(f"cannot remount a tmpfs {mode} here (needs root)")


def _run_args(workdir, *sets_, steps: int, every: int) -> list:
    return ["train", "--config", TINY, *sets(MICRO), "--set", f"train.steps={steps}", "--set",
            f"train.checkpoint_every={every}", *sets(sets_), "--workdir", workdir, "--no-progress"]


def _read_only_line(directory) -> str:
    return (f"error: {directory}: Read-only file system; make it writable (or use another directory), then rerun "
            f"the same command")


@pytest.mark.slow
def test_a_read_only_workdir_ends_a_new_run_in_one_line(small_disk):
    _remount(small_disk, "ro")
    code, err = _user_stderr(*_run_args(small_disk / "run", steps=2, every=2))
    assert code == 1 and len(err) <= 3, err
    assert err[-1] == _read_only_line(small_disk / "run"), err


@pytest.mark.slow
def test_a_run_on_a_disk_turned_read_only_is_refused_in_one_line_and_a_rerun_resumes_exactly(small_disk):
    """Killed after step 7 (checkpoint 4 complete), then its disk turns read-only: the resume stops in one line
    naming the run directory and what to do; writable again, the rerun resumes from step 4 and trains the steps after
    it again exactly as they went before."""
    workdir = small_disk / "run"
    args = _run_args(workdir, steps=8, every=4)
    code, err = _user_stderr(*args, env={faults.ENV: "SIGKILL@7"})
    assert code == -9, err
    _remount(small_disk, "ro")
    code, err = _user_stderr(*args)
    assert code == 1 and len(err) <= 3, err
    assert err[-1] == _read_only_line(workdir), err
    _remount(small_disk, "rw")
    code, err = _user_stderr(*args)
    assert code == 0, err
    assert_redone_exactly(workdir, at_least=2)
    assert max(losses(workdir)) == 8


def _corpus(path, docs: int, words: int):
    """`docs` paragraphs of about 10 + 5·`words` bytes (byte tokens) each."""
    path.write_text("\n\n".join(f"Doc {i:04d}: " + "word " * (words + i % 3) for i in range(docs)))
    return path


def _prepared(tmp_path, docs: int, words: int, shard_tokens: int):
    from diffjax.data import prepare

    shards = tmp_path / "shards"
    prepare.prepare(_corpus(tmp_path / "corpus.txt", docs, words), shards, tokenizer="byte", workers=1,
                    shard_tokens=shard_tokens, progress=False, log=lambda *_: None)
    return shards, sorted(shards.glob("*.array_record"))


def _contents(workdir) -> dict:
    return {p: p.read_bytes() for p in map(workdir.joinpath, _listing(workdir)) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_a_shard_gone_before_a_resume_is_one_line_and_the_run_is_left_as_it_was(tmp_path, monkeypatch):
    """A stopped run's prepared shard is removed: the resume exits 2 with one line naming it and what to do, and
    writes nothing. (A missing text corpus: test_studies' missing-corpus test.)"""
    data, files = _prepared(tmp_path, docs=200, words=12, shard_tokens=2000)
    gone = files[1]
    workdir = tmp_path / "run"
    args = _run_args(workdir, "data.source=shards", f"data.path={data}", steps=8, every=2)
    _stopped_at(monkeypatch, 4, _config("data.source=shards", f"data.path={data}", steps=8), workdir)
    before = _contents(workdir)
    gone.unlink()
    code, err = _user_stderr(*args)
    assert code == 2 and len(err) <= 3, err
    assert err[-1] == (f"data error: {gone}: missing, though {data / 'metadata.json'} lists it: put the shards back "
                       f"(or rerun `diffjax prepare`), then rerun the same command"), err
    assert _contents(workdir) == before


@pytest.mark.slow
def test_shards_removed_while_a_run_reads_them_end_it_in_one_line_and_a_rerun_resumes_exactly(tmp_path):
    """A text corpus is read whole when a run starts, and a shard that the run's reader holds open stays readable
    (Linux keeps a removed open file), but prepared shards are opened as the run reaches their documents: the run
    stops itself after step 10 (SIGSTOP, `faults`; checkpoint 10 complete), its shards are removed, and it goes on.
    Each document is a shard of its own, so the first document read after that fails, some steps on (the reader
    runs 32 documents, about 5 steps, ahead): the run ends in one line naming that shard and what to do, and with the
    shards back the rerun resumes from step 10 and trains again exactly the steps that ended with the run."""
    shards, files = _prepared(tmp_path, docs=300, words=14, shard_tokens=1)  # ~6 documents a step
    assert len(files) == 300
    workdir = tmp_path / "run"
    args = _run_args(workdir, "data.source=shards", f"data.path={shards}", steps=20, every=10)
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"} | {faults.ENV: "SIGSTOP@10"}
    with open(tmp_path / "stderr", "w+") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "diffjax.cli", *map(str, args)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        try:
            _, status = os.waitpid(run.pid, os.WUNTRACED)  # returns once the run has stopped itself
            assert os.WIFSTOPPED(status), f"the run ended ({status}) instead of stopping at step 10"
            aside = tmp_path / "aside"
            aside.mkdir()
            for file in files:
                file.rename(aside / file.name)
            os.kill(run.pid, signal.SIGCONT)
            code = run.wait(timeout=600)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        stderr.seek(0)
        err = stderr.read().splitlines()
    assert code == 2 and len(err) <= 3, err
    assert re.fullmatch(
        rf"data error: {re.escape(str(shards))}/shard-\w+-\d{{5}}\.array_record: removed while the run read the shards "
        r"\(299 more are gone too\): put them back, then rerun the same command \(a training run resumes from its "
        r"last checkpoint\)", err[-1]), err
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10"]
    for file in files:
        (aside / file.name).rename(file)
    code, err = _user_stderr(*args)
    assert code == 0, err
    assert_redone_exactly(workdir, at_least=1)
    assert max(losses(workdir)) == 20

"""`diffjax sweep`: members of a group train as they would alone (exactly when stepped serially, to float32
rounding when vmapped), `sweep.execution` and its auto rule, grouping splits on structure,
a diverging member is frozen without touching the others, sharding members over devices changes nothing, and a
killed sweep resumes exactly."""

import dataclasses
import json
import signal
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import MICRO as HELPER_MICRO
from helpers import TINY, assert_redone_exactly, cli_env, diffjax, losses, sets

from diffjax import cli, sharding
from diffjax import config as config_lib
from diffjax import sweep as sweep_lib
from diffjax.aot import targets
from diffjax.config import ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.sweep import Sweep, SweepOptions, product, variants, zipped
from diffjax.sweep.runner import chunk_members, run_sweep
from diffjax.sweep.spec import structure_key
from diffjax.train import faults, optim
from diffjax.train.loop import fit, train
from diffjax.train.members import Members, Stack, resolve
from diffjax.train.metrics import read_metrics

MICRO = [*HELPER_MICRO, "train.checkpoint_every=1000"]
# float32 throughout; a vmapped matmul may sum in another order than the same matmul alone
RTOL = 2e-5


def base_config(*overrides, steps=6):
    return config_lib.load(TINY, MICRO + [f"train.steps={steps}", *overrides])


def member_losses(workdir, name) -> dict[int, float]:
    return losses(Path(workdir) / "members" / name)


def telemetry(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(workdir) if r["split"] == "telemetry"}


def _records(workdir, split) -> dict[int, dict]:
    """step -> a record's values (a sweep member's extra `diverged` flag aside)."""
    return {r["step"]: {k: v for k, v in r.items() if k != "diverged"} for r in read_metrics(workdir)
            if r["split"] == split}


@pytest.mark.slow
def test_a_member_trains_as_it_would_alone_under_either_execution(tmp_path, capsys):
    base = base_config("train.telemetry_every=3")
    sweep = Sweep.build(base, variants({"base": {}, "lr": {"optim.lr": 3e-3, "optim.final_lr": 1e-4},
                                        "lam": {"model.lambda_init": 0.5}}), seeds=2)
    assert len(sweep.groups()) == 1  # seed, lr and constant λ_init are numeric: one program
    for execution in ("vmap", "serial"):
        run_sweep(dataclasses.replace(sweep, options=SweepOptions(execution=execution)), tmp_path / execution,
                  progress=False)
    for name in ("base__seed1", "lr__seed0", "lam__seed0"):
        member = next(m for m in sweep.members if m.name == name)
        train(member.config, tmp_path / name, progress=False)
        alone = losses(tmp_path / name)
        serial, vmapped = member_losses(tmp_path / "serial", name), member_losses(tmp_path / "vmap", name)
        assert sorted(alone) == sorted(serial) == sorted(vmapped) == [2, 3, 4, 5, 6]
        # serial runs the single run's own unbatched computation on the member's slice: bitwise equal, in
        # training, validation and telemetry alike
        assert serial == alone, name
        for split in ("val", "telemetry"):
            assert _records(tmp_path / "serial" / "members" / name, split) == _records(tmp_path / name, split)
        # vmap batches the matmuls, which may sum in another order (RTOL), against the run alone and so against
        # serial, which is that run
        np.testing.assert_allclose([vmapped[s] for s in alone], [alone[s] for s in alone], rtol=RTOL, err_msg=name)
        np.testing.assert_allclose([vmapped[s] for s in alone], [serial[s] for s in alone], rtol=RTOL, err_msg=name)
        alone, vmapped = telemetry(tmp_path / name), telemetry(tmp_path / "vmap" / "members" / name)
        assert sorted(alone) == sorted(vmapped) == [3, 6]
        for key in ("entropy_a1", "entropy_net", "max_logit_a2", "head_rms_normed"):
            np.testing.assert_allclose(vmapped[6][key], alone[6][key], rtol=1e-4, err_msg=f"{name} {key}")
        assert (tmp_path / "serial" / "members" / name / "telemetry.png").exists()
    # the members really differ
    assert member_losses(tmp_path / "serial", "base__seed0")[6] != member_losses(tmp_path / "serial", "lr__seed0")[6]
    # each member directory is a run: `diffjax eval` works on it; the sweep directory itself names them
    assert cli.main(["eval", "--workdir", str(tmp_path / "serial" / "members" / "lr__seed0")]) == 0
    assert cli.main(["eval", "--workdir", str(tmp_path / "serial")]) == 2
    err = capsys.readouterr().err
    assert f"is a sweep directory, not a run: evaluate one of its members, e.g. --workdir {tmp_path / 'serial'}" \
        in err and "(members: base__seed0, base__seed1, lam__seed0" in err


def test_execution_option_auto_rule_and_one_program_per_group(tmp_path, capsys):
    sweep = Sweep.build(base_config(), *product({"optim.lr": [1e-3, 2e-3]}))
    with pytest.raises(ConfigError, match=r"sweep.execution: unknown 'batched'"):
        dataclasses.replace(sweep, options=SweepOptions(execution="batched")).check()
    with pytest.raises(ConfigError, match=r"sweep.execution: 'serial' .* sweep.devices=2 shards the members"):
        dataclasses.replace(sweep, options=SweepOptions(execution="serial", devices=2)).check()
    code = cli.main(["sweep", "--config", "configs/sweep_demo.py", "--set", "sweep.execution=serial", "--set",
                     "sweep.devices=2", "--workdir", str(tmp_path), "--no-progress"])
    assert code == 2 and "sweep.execution: 'serial'" in capsys.readouterr().err
    # auto: serial on this CPU, vmap when the members are split over devices or on an accelerator's devices
    cpu = {d: sharding.make_mesh(config_lib.MeshConfig(data=1), sweep=d) for d in (1, 2)}
    assert [resolve("auto", cpu[1]), resolve("auto", cpu[2])] == ["serial", "vmap"]
    assert resolve("vmap", cpu[1]) == "vmap" and resolve("serial", cpu[1]) == "serial"
    for target in ("h100x1", "v5e-1"):
        devices = targets.devices(targets.parse(target))
        assert resolve("auto", sharding.make_mesh(config_lib.MeshConfig(data=1), devices)) == "vmap"
    # serial: one program whatever the number of members (the step is compiled once per group, not per member)
    lines = {}
    for n in (2, 4):
        wide = Sweep.build(base_config("mesh.data=1"), *product({"optim.lr": [1e-3, 2e-3, 3e-3, 4e-3][:n]}))
        stack = Stack.build(chunk_members(wide, wide.members, tmp_path, tmp_path / "state"))
        assert stack.execution == "serial"
        batch = stack.put_batch([it.next() for it in stack.iterators()])
        lowered = stack.train_fn().lower(stack.abstract, batch)
        lines[n] = len(lowered.as_text().splitlines())
    assert lines[2] == lines[4]


def test_a_run_is_a_stack_of_one(tmp_path):
    """A run and a one-member chunk of the same config step one compiled program, whatever the sweep's execution,
    and write the same records, bitwise (a one-layer model's λ a list in both); the run's checkpoint keeps a run's
    layout, no member axis. `train`'s result is its member's, `fit`'s one record per member."""
    sweep = Sweep.build(base_config("model.n_layers=1", "train.eval_every=2", steps=2),
                        *product({"optim.lr": [1e-3, 2e-3]}), options=SweepOptions(execution="vmap"))
    one_member = chunk_members(sweep, sweep.members[:1], tmp_path / "one", tmp_path / "one" / "state")
    programs = []
    for members in (Members.run(sweep.members[0].config, tmp_path / "run"), one_member):
        stack = Stack.build(members)
        batch = stack.put_batch([it.next() for it in stack.iterators()])
        programs.append(stack.train_fn().lower(stack.abstract, batch).as_text())
    assert programs[0] == programs[1]
    run = train(sweep.members[0].config, tmp_path / "run", progress=False)
    one = fit(one_member, progress=False)
    two = fit(chunk_members(sweep, sweep.members, tmp_path / "two", tmp_path / "two" / "state"), progress=False)
    ran, member = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "one" / "members" / sweep.members[0].name)
    assert [r["split"] for r in ran] == ["val", "train"] and [r["diverged"] for r in ran] == [False, False]
    timing = {"tokens_per_s", "tflops_per_s", "mfu"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in member] == \
        [{k: v for k, v in r.items() if k not in timing} for r in ran]
    assert isinstance(ran[1]["lambda"], list)
    assert one.vals == [run.val] and len(two.vals) == 2 and two.vals[0] != two.vals[1]
    saved = ocp.StandardCheckpointer().metadata(tmp_path / "run" / "checkpoints" / "2" / "state")
    saved = getattr(saved, "item_metadata", saved)
    shapes = lambda tree: sorted(tuple(x.shape) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))  # noqa: E731
    assert shapes(saved) == shapes(run.state)  # no member axis


def test_grouping_and_bad_members():
    base = base_config()
    sweep = Sweep.build(base, variants({"diff": {}, "base": {"model.arch": "transformer", "model.n_heads": 2},
                                        "nonorm": {"model.headwise_norm": False}}),
                        *product({"optim.b2": [0.95, 0.99], "model.init_std": [0.02, 0.05]}), seeds=2)
    groups = sweep.groups()
    assert [len(g) for g in groups] == [8, 8, 8]  # structure: arch / headwise norm; numbers stay inside a group
    assert {m.variant.split(",")[0] for m in groups[1]} == {"base"}
    structural = Sweep.build(base, zipped({"data.seq_len": [64, 48], "data.batch_size": [8, 4]}),
                             *product({"optim.clip_norm": [0.0, 1.0, 0.5]}))
    assert [len(g) for g in structural.groups()] == [1, 2, 1, 2]  # no clipping is structural; its norm is not
    with pytest.raises(ConfigError, match=r"sweep member 'bad__seed0': model.n_layers"):
        Sweep.build(base, variants({"ok": {}, "bad": {"model.n_layers": "two"}}))
    with pytest.raises(ConfigError, match=r"sweep member 'lam__seed0': model.lambda_init"):
        Sweep.build(base, variants({"lam": {"model.lambda_init": 1.5}}))


def test_sweep_devices_must_split_every_chunk_at_load(tmp_path, capsys):
    three = product({"optim.lr": [1e-3, 2e-3, 3e-3]})
    with pytest.raises(ConfigError, match=r"sweep.devices=2 must divide .* group 1 has 3"):
        Sweep.build(base_config(), *three, options=SweepOptions(devices=2))
    with pytest.raises(ConfigError, match=r"group 1 chunk 2 has 1 \(chunk sizes: \[1, 3\]"):
        Sweep.build(base_config(), *product({"optim.lr": [1e-3, 2e-3, 3e-3, 4e-3]}),
                    options=SweepOptions(devices=3, chunk=3))
    assert len(Sweep.build(base_config(), *three, seeds=2, options=SweepOptions(devices=3, chunk=3)).chunks()) == 2
    code = cli.main(["sweep", "--config", "configs/sweep_demo.py", "--set", "sweep.devices=4", "--workdir",
                     str(tmp_path), "--no-progress"])
    assert code == 2 and "sweep.devices=4 must divide" in capsys.readouterr().err


@pytest.mark.slow
def test_a_diverging_member_is_frozen_and_the_others_do_not_notice(tmp_path):
    """The others train as they do beside a member that does not diverge in its place (a learning rate between
    theirs): the same three-member program, run twice."""
    base = base_config("optim.max_nonfinite=2", steps=8)
    lrs = {"small": {"optim.lr": 1e-3, "optim.final_lr": 1e-4}, "huge": {"optim.lr": 1e6, "optim.final_lr": 1e6},
           "mid": {"optim.lr": 3e-3, "optim.final_lr": 1e-4}}
    with_huge = Sweep.build(base, variants(lrs))
    without = Sweep.build(base, variants({"small": lrs["small"], "calm": {"optim.lr": 2e-3, "optim.final_lr": 1e-4},
                                          "mid": lrs["mid"]}))
    assert [len(g) for g in with_huge.groups()] == [len(g) for g in without.groups()] == [3]
    run_sweep(with_huge, tmp_path / "with", progress=False)
    run_sweep(without, tmp_path / "without", progress=False)
    assert not any(r["diverged"] for r in read_metrics(tmp_path / "without" / "members" / "calm__seed0"))
    for name in ("small__seed0", "mid__seed0"):
        a, b = member_losses(tmp_path / "with", name), member_losses(tmp_path / "without", name)
        np.testing.assert_allclose([a[s] for s in b], [b[s] for s in b], rtol=RTOL)
    huge = [r for r in read_metrics(tmp_path / "with" / "members" / "huge__seed0") if r["split"] == "train"]
    assert huge[-1]["diverged"] and huge[-1]["skipped"] == 1
    # the single run's rule: a non-finite step is skipped; `max_nonfinite` of them in a row end the member
    runs = [r["nonfinite_run"] for r in huge]
    assert [r["diverged"] for r in huge] == [n >= 2 or (i and huge[i - 1]["diverged"]) for i, n in enumerate(runs)]
    assert 1 in runs and any(r["diverged"] for r in huge)
    assert cli.main(["sweep", "--report", str(tmp_path / "with")]) == 0
    rows = (tmp_path / "with" / "results.csv").read_text().splitlines()
    assert [r.split(",")[-1] for r in rows] == ["diverged", "False", "True", "False"]
    assert "| huge | — | 0/1 | 1 |" in (tmp_path / "with" / "results.md").read_text()


@pytest.mark.slow
def test_sharding_members_over_devices_changes_nothing(tmp_path):
    """Four members (two learning rates × two seeds), one per device, against the same sweep on one device."""
    sweep = Sweep.build(base_config("mesh.data=1"), *product({"optim.lr": [1e-3, 3e-3]}), seeds=2)
    run_sweep(sweep, tmp_path / "one", progress=False)
    sharded = dataclasses.replace(sweep, options=SweepOptions(devices=4))
    run_sweep(sharded, tmp_path / "sharded", progress=False)
    for m in sweep.members:
        a, b = member_losses(tmp_path / "one", m.name), member_losses(tmp_path / "sharded", m.name)
        np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=RTOL, err_msg=m.name)


def test_vary_data_gives_each_member_its_own_batches(tmp_path):
    sweep = sweep_lib.load("configs/sweep_demo.py:seeds=2,steps=2", ["sweep.vary_data=true", *MICRO[:9]])
    seeds = [m.config.data.seed for m in sweep.members]
    assert len(set(seeds)) == len(seeds) and len(sweep.groups()) == 2
    group = sweep.groups()[0]
    stack = Stack.build(chunk_members(sweep, group, tmp_path, tmp_path / "state"))
    batch = stack.put_batch([it.next() for it in stack.iterators()])  # stacked [members, batch, seq], on the mesh
    for i, member in enumerate(group):  # member i's rows are its own iterator's first batch
        own = make_iterator(member.config.data, split="train").next()
        np.testing.assert_array_equal(np.asarray(batch["tokens"][i]), own["tokens"])
    assert not np.array_equal(np.asarray(batch["tokens"][0]), np.asarray(batch["tokens"][1]))


STEPS = 10


def _run_cli(workdir, log, fault=None):
    env = cli_env() | ({faults.ENV: fault} if fault else {})  # "SIGKILL@9": stops itself there (train/faults.py)
    return diffjax("sweep", "--config", "configs/sweep_demo.py:seeds=1", "--workdir", workdir, "--no-progress",
                   *sets([*MICRO[:-1], "train.checkpoint_every=5", f"train.steps={STEPS}"]), env=env, log=log)


@pytest.mark.slow
def test_sigkill_then_resume_redoes_the_lost_steps_exactly(tmp_path):
    """Killed after step 9 of its first group (checkpoint at 5), the sweep resumes there: each of that group's
    members (two learning rates) trains steps 6-9 again to the losses it had, bitwise, and the sweep finishes (its
    second group, not started before the kill, too). Under the default
    execution (serial on this CPU); the checkpointed state is the same stacked tree under vmap, so resume does not
    depend on the choice."""
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115
    tail = lambda: (tmp_path / "log.txt").read_text()[-3000:]  # noqa: E731
    assert _run_cli(tmp_path, log, "SIGKILL@9").wait(timeout=400) == -signal.SIGKILL, tail()
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    first, later = sweep["groups"][0], [m for group in sweep["groups"][1:] for m in group]
    assert len(first) == 2 and all(max(member_losses(tmp_path, m)) == 9 for m in first) and later
    assert _run_cli(tmp_path, log).wait(timeout=400) == 0, tail()
    for name in (m["name"] for m in sweep["members"]):
        assert max(member_losses(tmp_path, name)) == STEPS, name
    for name in first:
        assert_redone_exactly(tmp_path / "members" / name, at_least=3)  # 7-9: a start logs from its second step


def test_a_groups_members_differ_only_in_the_fields_marked_traced(rng):
    """The fields marked `traced` (`config.setting`) are those a group's members may differ in: each changed alone
    keeps the member in the group, a change of any other field starts another. The optimizer's (marked `state`) are
    numbers its state holds, by the names the state gives them (`optim.STATE_NAMES`, which other code imports)."""
    assert set(sweep_lib.NUMERIC) == {"train.seed", "data.seed", "optim.lr", "optim.final_lr", "optim.weight_decay",
                                      "optim.clip_norm", "optim.b1", "optim.b2", "optim.eps", "model.lambda_init",
                                      "model.init_std"}
    assert optim.STATE_NAMES == {"lr": "peak_lr", "final_lr": "final_lr", "b1": "b1", "b2": "b2", "eps": "eps",
                                 "weight_decay": "weight_decay", "clip_norm": "max_norm"}
    base = base_config("model.lambda_init=0.5")
    scale = float(rng.uniform(0.5, 0.9))  # keeps each number valid: a beta, λ_init below 1, clipping still on
    for key in sweep_lib.NUMERIC:
        section, field = key.split(".")
        value = getattr(getattr(base, section), field)
        changed = config_lib.replace_field(base, key, value + 1 if isinstance(value, int) else value * scale)
        assert structure_key(changed.validate()) == structure_key(base), key
    for key, value in (("optim.warmup_steps", 3), ("model.n_layers", 1), ("data.split_seed", 5)):
        assert structure_key(config_lib.replace_field(base, key, value)) != structure_key(base), key
    state = optim.make_optimizer(base.optim, 10).init({"dense": {"kernel": np.ones((2, 2), np.float32)}})
    assert all(optim.has_hyperparam(state, name) for name in optim.STATE_NAMES.values())


def test_a_chunk_whose_every_member_diverged_stops_and_the_sweep_goes_on(tmp_path):
    """Once every member of a chunk is frozen nothing is left to train: the chunk stops at that step, its members
    are saved and marked diverged, and the next chunk trains (a run in the same state raises instead:
    test_train.py::test_run_stops_after_max_nonfinite_in_a_row)."""
    sweep = Sweep.build(base_config("optim.max_nonfinite=2", steps=8),
                        variants({"nan": {"model.init_std": float("nan")}, "ok": {"model.init_std": 0.02}}),
                        seeds=2, options=SweepOptions(chunk=2, execution="vmap"))
    assert [[m.variant for m in c] for _, _, c in sweep.chunks()] == [["nan", "nan"], ["ok", "ok"]]
    assert run_sweep(sweep, tmp_path, progress=False).interrupted is None
    done = [json.loads((tmp_path / "state" / f"group0_chunk{c}" / "done.json").read_text())["step"] for c in (0, 1)]
    assert done[0] < 8 and done[1] == 8
    for m in sweep.members:
        train_records = [r for r in read_metrics(tmp_path / "members" / m.name) if r["split"] == "train"]
        assert train_records[-1]["diverged"] == (m.variant == "nan"), m.name
        assert (tmp_path / "members" / m.name / "checkpoints").is_dir()

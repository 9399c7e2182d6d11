"""Training: optimizer schedule and decay mask, the step (accumulation, non-finite skipping), sharded runs,
checkpoint resume (in process, after SIGKILL, onto another mesh) and corrupt-checkpoint fallback."""

import dataclasses
import re
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import MICRO, TINY, assert_resumed_exactly, cli_env, diffjax, losses, sets

from diffjax import cli, sharding
from diffjax import config as config_lib
from diffjax.data.pipeline import make_iterator
from diffjax.train import checkpoint, faults
from diffjax.train.loop import NonFiniteError, train
from diffjax.train.metrics import read_metrics
from diffjax.train.optim import decay_mask, make_optimizer, schedule, set_hyperparams
from diffjax.train.run_loader import load_run
from diffjax.train.state import init_state, state_shardings
from diffjax.train.step import train_step


def micro_config(*overrides, steps=6):
    return config_lib.load(TINY, MICRO + [f"train.steps={steps}", *overrides])


def test_schedule_warmup_peak_and_final_lr():
    cfg = config_lib.OptimConfig(lr=1e-3, final_lr=1e-4, warmup_steps=10)
    lr = jax.jit(schedule(cfg, total_steps=50))  # one program for the 44 scalar calls, not each op compiled alone
    np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(49)], [0.0, 5e-4, 1e-3, 1e-4], rtol=1e-6, atol=1e-12)
    values = np.array([lr(i) for i in range(10, 50)])
    assert np.all(np.diff(values) < 0)  # linear decay after the peak


@pytest.mark.parametrize("clip_norm", [0.5, 0.0], ids=["clipped", "unclipped"])
def test_the_optimizer_is_optax_adamw_after_its_numbers_are_set(rng, clip_norm):
    """Its numbers set from the config (as every run and sweep member does), diffjax's optimizer takes the steps of
    optax's own clip → adamw chain, with or without clipping (clip_norm = 0: no clipping step in the state)."""
    cfg = config_lib.OptimConfig(lr=1e-2, final_lr=1e-3, warmup_steps=2, weight_decay=0.1, clip_norm=clip_norm)
    params = {"w": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
              "norm": {"scale": jnp.asarray(rng.normal(size=3), jnp.float32)}}
    ours = make_optimizer(cfg, total_steps=6)
    peer = optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm else []),
                       optax.adamw(schedule(cfg, 6), cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay,
                                   mask=decay_mask))
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(4)]

    @jax.jit  # one program for the four steps of each (not an op at a time)
    def steps(params, grads):
        a, b = set_hyperparams(ours.init(params), cfg), peer.init(params)
        pa = pb = params
        for g in grads:
            ua, a = ours.update(g, a, pa)
            ub, b = peer.update(g, b, pb)
            pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
        return pa, pb

    pa, pb = steps(params, grads)
    chex.assert_trees_all_close(pa, pb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_decay_mask(decay_embeddings):
    cfg = micro_config()
    abstract, _ = state_shardings(cfg, sharding.make_mesh(cfg.mesh), make_optimizer(cfg.optim, 6))
    mask = decay_mask(abstract.params, decay_embeddings)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    for path, decays in flat.items():
        if "lambda_" in path or "scale" in path:  # norms and λ vectors: never
            assert not decays, path
        elif "embed" in path or "lm_head" in path:
            assert decays == decay_embeddings, path
        else:
            assert path.endswith("['kernel']") and decays, path
    assert sum(flat.values()) == 4 * 2 + 3 * 2 + (2 if decay_embeddings else 0)  # wq wk wv wo, 3 mlp; embeddings


def _state_and_batch(cfg):
    mesh = sharding.make_mesh(dataclasses.replace(cfg.mesh, data=1), jax.devices()[:1])
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    _, shardings = state_shardings(cfg, mesh, tx)
    batch = {k: jnp.asarray(v) for k, v in make_iterator(cfg.data).next().items()}
    return init_state(cfg, tx, shardings), batch, tx


def test_gradient_accumulation_equals_one_batch(rng):
    """The mean over all targets, not the mean of microbatch means: the microbatches get uneven target counts (each
    row keeps its first k targets, k random, redrawn until the four microbatches' counts are not all equal), where
    the two differ."""
    cfg = micro_config("optim.warmup_steps=0")
    state, batch, tx = _state_and_batch(cfg)
    mask = np.asarray(batch["loss_mask"])
    rows, t = mask.shape
    while True:
        kept = mask * (np.cumsum(mask, axis=1) <= rng.integers(1, mask.sum(1).min() + 1, rows)[:, None])
        if len(set(kept.reshape(rows // 4, 4, t).sum((0, 2)).tolist())) > 1:  # microbatch i: rows i::4
            break
    batch = {**batch, "loss_mask": jnp.asarray(kept)}
    one, m1 = jax.jit(lambda s, b: train_step(s, b, cfg=cfg, tx=tx))(state, batch)
    cfg4 = config_lib.override(cfg, "optim.grad_accum=4")
    four, m4 = jax.jit(lambda s, b: train_step(s, b, cfg=cfg4, tx=tx))(state, batch)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # Adam's first update is ±lr wherever |g| ≫ eps: a gradient within rounding of 0 (a vocabulary column no target
    # reaches) may take either sign, so single parameters may differ by up to 2·lr; the loss and gradient norm
    # above are the tight checks
    chex.assert_trees_all_close(four.params, one.params, rtol=1e-4, atol=2.5 * cfg.optim.lr)


def test_nonfinite_step_is_skipped_and_counted():
    cfg = micro_config("optim.warmup_steps=0")  # test_gradient_accumulation_equals_one_batch's state and step
    state, batch, tx = _state_and_batch(cfg)
    step = jax.jit(lambda s, b: train_step(s, b, cfg=cfg, tx=tx))
    bad = state.replace(params={**state.params, "embed": {"embedding": state.params["embed"]["embedding"] * jnp.nan}})
    after, metrics = step(bad, batch)
    assert int(metrics["skipped"]) == 1 and int(after.nonfinite_run) == 1 and int(after.nonfinite_total) == 1
    assert int(after.step) == 1 and int(after.updates) == 0
    chex.assert_trees_all_equal(after.opt_state, bad.opt_state)
    good, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 0 and int(good.nonfinite_run) == 0


def test_a_batch_the_devices_or_microbatches_cannot_split_is_refused_before_compiling(tmp_path, capsys):
    """Rows go over data×fsdp devices (and so over processes) and into grad_accum microbatches: each must divide."""
    base = ["train", "--config", TINY, *sets(MICRO), "--workdir", str(tmp_path), "--no-progress"]
    devices = jax.device_count()
    for extra, message in [(["data.batch_size=6", "mesh.data=-1"],
                            f"data.batch_size: 6 must be divisible by data×fsdp devices ({devices}) × "
                            "optim.grad_accum (1)"),
                           (["data.batch_size=8", "mesh.data=2", "mesh.fsdp=2", "optim.grad_accum=4"],
                            "data.batch_size: 8 must be divisible by data×fsdp devices (4) × optim.grad_accum (4)")]:
        assert cli.main(base + sets(extra)) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()  # refused before the run is recorded


def test_run_stops_after_max_nonfinite_in_a_row(tmp_path):
    # 4 steps: the train step of test_corrupt_latest_checkpoint_falls_back_with_a_warning's run (init_std is traced
    # into the init, max_nonfinite is read on the host); it stops at the third
    cfg = micro_config("model.init_std=nan", "optim.max_nonfinite=3", steps=4)
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        train(cfg, tmp_path, progress=False)


def test_loss_falls_on_tiny_config(tmp_path):
    cfg = micro_config("optim.lr=3e-3", "data.mqar_vocab=16", steps=80)
    train(cfg, tmp_path, progress=False)
    by_step = losses(tmp_path)
    first, last = np.mean([by_step[s] for s in range(2, 12)]), np.mean([by_step[s] for s in range(70, 81)])
    assert last < 0.8 * first, (first, last)
    for record in read_metrics(tmp_path):
        assert record["perplexity"] == pytest.approx(np.exp(record["loss"]), rel=1e-6)
    assert tensorboard_scalars(tmp_path, "train/loss") == pytest.approx(by_step, rel=1e-6)


def tensorboard_scalars(workdir, tag: str) -> dict[int, float]:
    """{step: value} of one tag in a run's TensorBoard event files (TFRecord framing: length, its CRC, data, CRC)."""
    from tensorboardX.proto import event_pb2

    values = {}
    for path in (workdir / "tensorboard").iterdir():
        data, at = path.read_bytes(), 0
        while at < len(data):
            length = int.from_bytes(data[at:at + 8], "little")
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = value.simple_value
    return values


@pytest.mark.slow  # a fresh process
def test_logging_to_tensorboard_does_not_import_torch(tmp_path):
    """tensorboardX imports torch where it is installed (seconds per process) unless the writer keeps it out. Torch
    or not (CI has none), a finder first on the import path records every attempt to import it."""
    code = f"""if True:
        import sys

        class Torch:  # sees every `import torch` the import system is asked for
            attempts = []

            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "torch":
                    self.attempts.append(name)

        sys.meta_path.insert(0, Torch())
        from diffjax.train.metrics import MetricsWriter
        writer = MetricsWriter(__import__("pathlib").Path({str(tmp_path)!r}))
        writer.write(1, {{"loss": 1.0}})
        writer.close()
        assert not Torch.attempts and "torch" not in sys.modules, f"torch was imported: {{Torch.attempts}}"
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((tmp_path / "tensorboard").iterdir()), "no TensorBoard events were written"


# the sharded runs' model and length (`micro_run` overrides): the 2×4 FSDP run is also the resume test's
SHARDED = ["train.steps=4", "model.n_heads=2", "model.d_model=64", "train.checkpoint_every=2"]
FSDP = ["mesh.data=2", "mesh.fsdp=4"]


@pytest.mark.parametrize("mesh", [FSDP, ["mesh.data=2", "mesh.tensor=4"]], ids=["data2xfsdp4", "data2xtensor4"])
@pytest.mark.slow
def test_sharded_run_matches_one_device(micro_run, tmp_path, mesh):
    # the one-device run: trained once per test session, for both meshes; the sharded runs too (the FSDP one is
    # test_resume_in_process_is_exact_and_restores_onto_another_mesh's)
    micro_run(tmp_path / "one", "train.steps=4", "mesh.data=1", "model.n_heads=2", "model.d_model=64")
    micro_run(tmp_path / "sharded", *SHARDED, *mesh)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "sharded")
    assert sorted(a) == sorted(b) == [2, 3, 4]  # step 1 includes compilation and is not logged
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=2e-5)


@pytest.mark.slow
def test_resume_in_process_is_exact_and_restores_onto_another_mesh(micro_run, tmp_path, monkeypatch):
    # the uninterrupted 2×4 run: test_sharded_run_matches_one_device's, trained once per test session
    full = micro_config(*SHARDED[1:], *FSDP, steps=4)
    micro_run(tmp_path / "full", *SHARDED, *FSDP)
    _, ref, _ = load_run(tmp_path / "full")  # its final state, as its last checkpoint holds it
    assert int(ref.step) == 4
    # the same run in two pieces: stopped after step 2 (SIGTERM from the `faults` hook: the run saves and returns),
    # then resumed to 4; the first piece saved as Orbax saves on CPU by default (each replicated array split over its
    # replicas, as diffjax once did too), the second writing arrays whole
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_whole_arrays_on_cpu", lambda: ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=True), override=True))
        m.setenv(faults.ENV, "SIGTERM@2")
        stopped = train(full, tmp_path / "split", progress=False)
    assert stopped.interrupted and stopped.step == 2, stopped.interrupted
    resumed = train(full, tmp_path / "split", progress=False)
    assert resumed.start_step == 2
    chex.assert_trees_all_equal(jax.device_get(resumed.state.params), jax.device_get(ref.params))
    # the 2×4 checkpoint restored onto one device, and onto a tensor-parallel mesh
    for mesh, n_devices in ((["mesh.data=1", "mesh.fsdp=1"], 1), (["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"], 8)):
        _, state, new_mesh = load_run(tmp_path / "full", mesh)
        assert new_mesh.devices.size == n_devices
        assert {d for x in jax.tree.leaves(state.params) for d in x.sharding.device_set} == set(new_mesh.devices.flat)
        chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(ref.params))


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(micro_run, tmp_path):
    cfg = micro_config("train.checkpoint_every=2", steps=4)
    micro_run(tmp_path, "train.steps=4", "train.checkpoint_every=2")  # that run, trained once per test process
    for file in (tmp_path / "checkpoints" / "4").rglob("*"):  # garble every file of the latest step
        if file.is_file():
            file.write_bytes(b"\0garbage")
    with pytest.warns(UserWarning, match="checkpoint step 4 .* unreadable"):
        out = train(config_lib.override(cfg, "train.steps=8"), tmp_path, progress=False, allow_config_change=True)
    assert out.start_step == 2


def _run_cli(workdir, steps, log, fault=None):
    """A MICRO run checkpointing every 10 steps; `fault` ("SIGKILL@25"): it sends itself that signal after that
    step (diffjax/train/faults.py), so the test knows where it stopped."""
    env = cli_env() | ({faults.ENV: fault} if fault else {})
    return diffjax("train", "--config", TINY, "--workdir", workdir, "--no-progress",
                   *sets([f"train.steps={steps}", "train.checkpoint_every=10", *MICRO]), env=env, log=log)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    """Killed after step 15 (its last checkpoint: step 10), the run resumes from 10 and logs the uninterrupted run's
    losses bitwise from there."""
    steps = 20
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115
    tail = lambda: (tmp_path / "log.txt").read_text()[-3000:]  # noqa: E731
    reference = _run_cli(tmp_path / "ref", steps, log)
    victim = _run_cli(tmp_path / "killed", steps, log, fault="SIGKILL@15")
    assert victim.wait(timeout=300) == -signal.SIGKILL, tail()
    assert max(losses(tmp_path / "killed")) == 15
    assert sorted(int(p.name) for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name.isdigit()) == [10]
    resumed = _run_cli(tmp_path / "killed", steps, log)
    assert resumed.wait(timeout=300) == 0, tail()
    assert reference.wait(timeout=300) == 0, tail()
    assert_resumed_exactly(tmp_path / "ref", tmp_path / "killed", 15, at_least=4)  # 17-20


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_before_exit(tmp_path):
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:  # SIGTERM after step 15, between the periodic checkpoints at 10 and 20
        run = _run_cli(tmp_path / "run", 20, log, fault="SIGTERM@15")  # the SIGKILL test's program
        assert run.wait(timeout=120) == 130, log_path.read_text()[-3000:]
    message = re.search(r"SIGTERM at step (\d+)", log_path.read_text())
    assert message, log_path.read_text()[-3000:]
    step = int(message.group(1))
    saved = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert step == 15 and max(saved) == 15  # saved at the step it stopped at, past the periodic one at 10

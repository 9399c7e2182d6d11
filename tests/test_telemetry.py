"""Stability telemetry: the attention statistics against NumPy on fresh random models and against hand-computed
values on uniform attention, the per-group gradient norms against the step's global norm and a NumPy sum over
the gradient tree, and the loop writing them (records every k steps on the fixed probe, telemetry.png)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MICRO, TINY

from diffjax import config as config_lib
from diffjax.data.pipeline import make_iterator, validation_iterator
from diffjax.model import lambda_inits
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics
from diffjax.train.optim import make_optimizer
from diffjax.train.run_loader import load_run
from diffjax.train.state import make_init
from diffjax.train.step import _summed_loss, train_step
from diffjax.train.telemetry import Telemetry, attention_stats


def micro(*overrides):
    return config_lib.load(TINY, [*MICRO, "train.steps=4", *overrides])


def random_params(cfg, seed):
    state = jax.jit(make_init(cfg, make_optimizer(cfg.optim, cfg.train.steps)))(np.uint32(seed))
    return state.params


def random_batch(cfg, rng, rows=2):
    t = cfg.data.seq_len
    return {"tokens": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (rows, t)), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t)),
            "segment_ids": jnp.ones((rows, t), jnp.int32)}


def numpy_stats(logits_by_map, lam, t):
    """Entropy (mean over rows) and max |logit| of causal softmax maps from their float64 logits [B, H, T, T]."""
    causal = np.tril(np.ones((t, t), bool))
    out, probs = {}, {}
    for name, logits in logits_by_map.items():
        z = np.where(causal, logits, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        probs[name] = p
        out[f"entropy_{name}"] = np.mean(-np.sum(np.where(causal, p * np.log(np.where(p > 0, p, 1)), 0), -1))
        out[f"max_logit_{name}"] = np.abs(logits[..., causal]).max()
    if len(probs) == 2:
        net = probs["a1"] - lam * probs["a2"]
        assert (net < 0).any()  # the premise of taking |net|
        net = np.abs(net)
        net /= net.sum(-1, keepdims=True)
        out["entropy_net"] = np.mean(-np.sum(np.where(net > 0, net * np.log(np.where(net > 0, net, 1)), 0), -1))
    return out


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_attention_statistics_match_numpy_on_a_random_model(rng, arch):
    heads = ["model.n_heads=2"] if arch == "transformer" else []
    cfg = micro(f"model.arch={arch}", *heads, "model.init_std=0.3")  # peaked maps: A1 − λ A2 has negative entries
    params = random_params(cfg, rng.integers(1 << 31))
    batch = random_batch(cfg, rng)
    stats = jax.jit(lambda p, b: attention_stats(p, b, cfg=cfg))(params, batch)
    from diffjax.model import DecoderLM, per_layer

    _, state = jax.jit(functools.partial(DecoderLM(cfg.model).apply, mutable=["intermediates"]))(
        {"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])
    t, d = cfg.data.seq_len, cfg.model.head_dim
    for i, layer in enumerate(per_layer(state["intermediates"], cfg.model)):
        q, k = (np.asarray(x, np.float64) for x in layer["attn"]["qk"][0])  # [B, T, H, d]
        logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
        maps = {"a1": logits[:, 0::2], "a2": logits[:, 1::2]} if arch == "diff" else {"a": logits}
        lam = float(layer["attn"]["lambda"][0]) if arch == "diff" else None
        for key, value in numpy_stats(maps, lam, t).items():
            np.testing.assert_allclose(float(stats[key][i]), value, rtol=2e-5, err_msg=f"{key} layer {i}")
        heads = np.asarray(layer["attn"]["heads"][0], np.float64)
        np.testing.assert_allclose(float(stats["head_rms"][i]), np.sqrt(np.mean(heads**2)), rtol=1e-5)
    assert ("head_rms_normed" in stats) == (arch == "diff")


def test_uniform_attention_gives_the_hand_computed_values(rng):
    """Zero query weights: every row of A1 and A2 is uniform over its t + 1 keys, so each map's mean entropy is
    mean_t log(t + 1), every logit is 0, and the net map (1 − λ)·uniform normalises to the same entropy; the
    head norm makes every head vector's RMS 1, times (1 − λ_init)."""
    cfg = micro("model.norm_eps=1e-12")
    params = random_params(cfg, rng.integers(1 << 31))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "wq" in jax.tree_util.keystr(path) else x, params)
    stats = jax.jit(functools.partial(attention_stats, cfg=cfg))(params, random_batch(cfg, rng, rows=3))
    t = cfg.data.seq_len
    expected = np.mean(np.log(np.arange(1, t + 1)))
    for key in ("entropy_a1", "entropy_a2", "entropy_net"):
        np.testing.assert_allclose(np.asarray(stats[key]), expected, rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(np.asarray(stats["max_logit_a1"]), 0.0)
    np.testing.assert_allclose(np.asarray(stats["head_rms_normed"]), 1 - np.asarray(lambda_inits(cfg.model)),
                               rtol=1e-5)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_group_gradient_norms_partition_the_global_norm(rng, scan):
    cfg = micro(f"model.scan_layers={scan}")
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state = jax.jit(make_init(cfg, tx))(np.uint32(rng.integers(1 << 31)))
    batch = {k: jnp.asarray(v) for k, v in make_iterator(cfg.data).next().items()}
    _, metrics = jax.jit(functools.partial(train_step, cfg=cfg, tx=tx))(state, batch)
    groups = np.concatenate([np.ravel(metrics[k]) for k in
                             ("grad_norm_embed", "grad_norm_attn", "grad_norm_mlp", "grad_norm_head")])
    np.testing.assert_allclose(np.sqrt(np.sum(groups**2)), float(metrics["grad_norm"]), rtol=1e-5)
    # each layer's attention group from a NumPy sum over the gradient leaves under that layer's attn / attn_norm
    (_, count), grads = jax.jit(jax.value_and_grad(functools.partial(_summed_loss, cfg=cfg, lambda_init=None),
                                                   has_aux=True))(state.params, batch)
    for i in range(cfg.model.n_layers):
        total = 0.0
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            key = jax.tree_util.keystr(path)
            if "'attn'" in key or "'attn_norm'" in key:
                if scan:
                    total += np.sum(np.asarray(g, np.float64)[i] ** 2)
                elif f"'layer_{i}'" in key:
                    total += np.sum(np.asarray(g, np.float64) ** 2)
        np.testing.assert_allclose(float(metrics["grad_norm_attn"][i]), np.sqrt(total) / float(count), rtol=1e-5)


def test_a_run_logs_telemetry_every_k_steps_on_the_fixed_probe(tmp_path):
    cfg = micro("train.telemetry_every=3", "train.steps=5", "train.telemetry_rows=2")
    result = train(cfg, tmp_path, progress=False)
    records = [r for r in read_metrics(tmp_path) if r["split"] == "telemetry"]
    assert [r["step"] for r in records] == [3, 5]  # every k steps and after the last
    # the last record is the probe (the first rows of the first validation batch) under the final params
    cfg, state, mesh = load_run(tmp_path)
    probe = {k: jnp.asarray(v[:2]) for k, v in validation_iterator(cfg.data).next().items()}
    again = jax.jit(functools.partial(attention_stats, cfg=cfg))(state.params, probe)
    for key, value in again.items():
        np.testing.assert_allclose(records[-1][key], np.asarray(value), rtol=1e-5, err_msg=key)
    assert Telemetry(cfg, mesh, stats_fn=None).probe["tokens"].shape == (2, cfg.data.seq_len)
    assert result.telemetry_png == tmp_path / "telemetry.png" and result.telemetry_png.stat().st_size > 10_000

"""Llama → DIFF (`diffjax hf import --as diff`): the converted model computes the Llama's function — against the
golden HF Llama's, Qwen2's (q/k/v biases), Qwen3's (q/k norms) and Mistral's own logits and against diffjax's
Llama on 'trained' weights — every new parameter can learn, the λ warm-up holds λ at 0 and then ramps, and the CLI
makes a run that trains."""

import dataclasses
import json
import math
import os
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import REPO, assert_resumed_exactly, losses, sets
from safetensors.numpy import load_file
from test_hf import FIXTURES, LIVE, logits, rel_err, trained_diff, transformers_logits
from test_tokenizer import FIXTURE as TOKENIZER

from diffjax.cli import main
from diffjax.config import ConfigError, ModelConfig, OptimConfig
from diffjax.hf import load_pretrained, save_pretrained
from diffjax.hf.llama_to_diff import llama_to_diff
from diffjax.hf.mapping import model_config
from diffjax.hf.run import import_run
from diffjax.model import DecoderLM, lambda_inits, layer_lambdas, per_layer, sown_per_layer
from diffjax.train import faults, run_config
from diffjax.train.loop import train
from diffjax.train.optim import make_optimizer
from diffjax.train.run_loader import load_run

LLAMA = ModelConfig(arch="transformer", vocab_size=512, d_model=48, n_layers=2, n_heads=4, head_dim=8, n_kv_heads=2,
                    ffn_dim=64, rope_theta=500.0, dtype="float32")


def loss(cfg, params, ids):
    out = jax.jit(DecoderLM(cfg).apply)({"params": params}, ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(out, ids[:, 1:]).mean()


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_golden_llama_converts_to_a_diff_model_with_its_logits(name):
    cfg, params = load_pretrained(FIXTURES / name)
    golden = load_file(str(FIXTURES / name / "golden.safetensors"))
    diff_cfg, diff_params = llama_to_diff(cfg, params)
    assert diff_cfg.arch == "diff" and diff_cfg.kv_heads == cfg.kv_heads < diff_cfg.n_heads == cfg.n_heads
    assert (diff_cfg.qkv_bias, diff_cfg.qk_norm, diff_cfg.hf_class) == (cfg.qkv_bias, cfg.qk_norm, None)
    err = rel_err(logits(diff_cfg, diff_params, golden["ids"]), golden["logits"])
    print(f"{name} --as diff: max relative logit error vs golden {err:.2e}")
    assert err <= 1e-4


def test_a_trained_llama_and_its_conversion_agree(rng):
    """Weights far from init (so A2, the new V half and a non-zero λ would all show), fresh ids."""
    params = trained_diff(LLAMA, seed=int(rng.integers(1 << 30)))
    ids = rng.integers(0, LLAMA.vocab_size, (2, 40))
    diff_cfg, diff_params = llama_to_diff(LLAMA, jax.tree.map(np.asarray, params), seed=int(rng.integers(1 << 30)))
    assert np.abs(np.asarray(layer_lambdas(diff_params, diff_cfg))).max() < 1e-6
    assert rel_err(logits(diff_cfg, diff_params, ids), logits(LLAMA, params, ids)) <= 1e-5
    # the DIFF model really has a second map: it is the λ = 0 that hides it
    moved = jax.tree.map(lambda x: x, diff_params)
    moved["layer_0"]["attn"]["lambda_k2"] = diff_params["layer_0"]["attn"]["lambda_k2"] * 0.5
    assert rel_err(logits(diff_cfg, moved, ids), logits(LLAMA, params, ids)) > 1e-3


def test_every_new_parameter_can_learn(rng):
    """At λ = 0 only λ and the new o_proj rows get gradient; once λ moves, Q2, K2 and the new V half do too (a
    zero Q2 and K2 — axolotl's zero-init — would never move)."""
    params = jax.tree.map(np.asarray, trained_diff(LLAMA, seed=int(rng.integers(1 << 30))))
    cfg, diff = llama_to_diff(LLAMA, params, seed=int(rng.integers(1 << 30)))
    ids = jnp.asarray(rng.integers(0, LLAMA.vocab_size, (2, 24)))
    h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim

    @jax.jit  # one program, not an op at a time
    def new_parts(grads):
        attn = grads["layer_1"]["attn"]
        cols = lambda name, n: attn[name]["kernel"].reshape(-1, n, 2, d)[:, :, 1]  # noqa: E731 -- odd blocks
        return {"lambda": sum(jnp.abs(attn[n]).sum() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")),
                "q2": jnp.abs(cols("wq", h)).sum(), "k2": jnp.abs(cols("wk", kv)).sum(),
                "v_new": jnp.abs(cols("wv", kv)).sum(),
                "wo_new": jnp.abs(attn["wo"]["kernel"].reshape(h, 2, d, -1)[:, 1]).sum()}

    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)
    at_zero = new_parts(grad(cfg, diff, ids))
    assert at_zero["lambda"] > 0 and at_zero["wo_new"] > 0 and at_zero["v_new"] == 0
    moved = jax.tree.map(lambda x: x, diff)
    for i in range(cfg.n_layers):
        moved[f"layer_{i}"]["attn"]["lambda_k2"] = diff[f"layer_{i}"]["attn"]["lambda_k2"] * 0.9
        wo = moved[f"layer_{i}"]["attn"]["wo"]["kernel"].reshape(h, 2, d, -1).copy()
        wo[:, 1] = 0.05 * rng.standard_normal(wo[:, 1].shape)  # as one step on the new o rows leaves them
        moved[f"layer_{i}"]["attn"]["wo"]["kernel"] = wo.reshape(-1, cfg.d_model)
    after = new_parts(grad(cfg, moved, ids))
    assert all(float(v) > 0 for v in after.values()), after
    for name in ("q2", "k2"):  # ∝ λ, which is 0 up to float32 rounding at conversion
        assert at_zero[name] < 1e-4 * after[name], (name, at_zero[name], after[name])


def test_lambda_warmup_scales_only_the_lambda_updates():
    """Same gradients through the optimizer with and without the warm-up: the λ vectors' updates are scaled by
    min(1, t / N) at update t (0 at the first), everything else is identical."""
    cfg, params = llama_to_diff(LLAMA, jax.tree.map(np.asarray, trained_diff(LLAMA)))
    base = OptimConfig(lr=1e-3, warmup_steps=0)
    plain, warm = make_optimizer(base, 10), make_optimizer(dataclasses.replace(base, lambda_warmup_steps=4), 10)

    @jax.jit  # the six updates of both in one program (not an op at a time)
    def layer_0_updates(params):
        plain_state, warm_state, key, out = plain.init(params), warm.init(params), jax.random.key(0), []
        for t in range(6):
            step_key = jax.random.fold_in(key, t)
            grads = jax.tree.map(lambda x, k=step_key: jax.random.normal(k, x.shape), params)
            u_plain, plain_state = plain.update(grads, plain_state, params)
            u_warm, warm_state = warm.update(grads, warm_state, params)
            out.append((u_plain["layer_0"]["attn"], u_warm["layer_0"]["attn"]))
        return out

    for t, (attn_p, attn_w) in enumerate(layer_0_updates(params)):
        np.testing.assert_allclose(attn_w["lambda_q2"], min(1.0, t / 4) * attn_p["lambda_q2"], rtol=1e-6)
        np.testing.assert_array_equal(attn_w["wq"]["kernel"], attn_p["wq"]["kernel"])


def test_only_a_llama_converts():
    cfg, params = load_pretrained(FIXTURES / "diffllama")
    with pytest.raises(ConfigError, match="converts a Llama"):
        llama_to_diff(cfg, params)


@pytest.mark.slow  # end to end through the CLI
def test_the_cli_converts_a_llama_into_a_run_that_trains(tmp_path, capsys, rng):
    params = trained_diff(LLAMA, seed=int(rng.integers(1 << 30)))
    save_pretrained(LLAMA, params, tmp_path / "llama")
    overrides = ["train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.telemetry_every=0",
                 "data.seq_len=64", "data.batch_size=2",
                 "data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6", "train.eval_batches=1", "mesh.data=1",
                 "optim.lambda_warmup_steps=5", "optim.warmup_steps=0", "optim.lr=3e-4", "optim.final_lr=3e-5"]
    args = ["hf", "import", str(tmp_path / "llama"), "--as", "diff", "--workdir", str(tmp_path / "run")]
    assert main(args + [a for o in overrides for a in ("--set", o)]) == 0
    assert "converted from a Llama" in capsys.readouterr().out
    cfg, state, _ = load_run(tmp_path / "run")
    ids = rng.integers(0, LLAMA.vocab_size, (2, 16))
    assert cfg.model.arch == "diff" and int(state.step) == 0
    assert rel_err(logits(cfg.model, state.params, ids), logits(LLAMA, params, ids)) <= 1e-5
    # fine-tuning: `diffjax train --workdir RUN` continues the run with its own config
    assert main(["train", "--workdir", str(tmp_path / "run"), "--no-progress"]) == 0
    _, trained, _ = load_run(tmp_path / "run")
    assert int(trained.step) == 2
    lam = np.asarray(layer_lambdas(trained.params, cfg.model))
    assert 1e-6 < np.abs(lam).max() < 1e-2  # held at 0 by the first update, moved by 1/5 of the second


def _sentences(rng, n: int) -> str:
    """Text a tiny model learns in a few dozen steps: sentences from a small grammar."""
    subjects, verbs, objects = ["the cat", "a dog", "the bird", "my friend"], ["sees", "likes", "finds"], \
        ["the ball", "a tree", "the house", "some water"]
    return "\n\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(n))


def whole_way_commands() -> list[list[str]]:
    """The commands of docs/hf.md's "The whole way" block, as the shell splits them (`~` left to expand)."""
    text = (REPO / "docs" / "hf.md").read_text()
    block = text[text.index("### The whole way"):].split("\n\n")[2]
    return [shlex.split(line.strip()) for line in block.splitlines()]


@pytest.mark.slow  # end to end through the CLI: docs/hf.md, "Llama → DIFF, the whole way"
def test_a_pretrained_llama_goes_to_diff_the_whole_way_with_its_own_tokenizer(tmp_path, monkeypatch, capsys, rng):
    """docs/hf.md's walkthrough as printed, relative paths and all, from a project directory (shortened only by
    `--set`s appended to the imports), on a stand-in for a real checkpoint in ~/models/llama: a small Llama
    pretrained by diffjax on text with an HF tokenizer and exported as HF ships one. Imported as a Llama and as DIFF,
    it scores the same validation loss on the corpus prepared with its own tokenizer; the DIFF run fine-tunes from
    the pretrained level, λ learns, it generates. Then every command takes the runs from another directory, and
    from inside runs/; the converted run's export is refused naming what can go."""
    home, project, elsewhere = tmp_path / "home", tmp_path / "project", tmp_path / "elsewhere"
    for d in (home, project, elsewhere):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (project / "corpus.txt").write_text(_sentences(rng, 400))
    pretrain = ["model.d_model=64", "model.n_layers=2", "model.vocab_size=448", f"data.tokenizer={TOKENIZER}",
                "train.steps=60", "train.eval_every=60", "train.checkpoint_every=60", "optim.lr=3e-3",
                "optim.warmup_steps=5", "data.source=text", f"data.path={project / 'corpus.txt'}", "data.seq_len=64",
                "data.batch_size=8", "train.eval_batches=2", "train.telemetry_every=0", "mesh.data=1"]
    assert main(["train", "--config", "configs/small.py:size=tiny,arch=transformer", *sets(pretrain),
                 "--workdir", str(tmp_path / "pretrained"), "--no-progress"]) == 0
    assert main(["hf", "export", "--workdir", str(tmp_path / "pretrained"),
                 "--out", str(home / "models" / "llama")]) == 0

    short = ["train.steps=6", "train.eval_every=6", "train.checkpoint_every=6", "optim.lr=1e-3",
             "optim.warmup_steps=0", "train.eval_batches=2", "train.telemetry_every=0", "mesh.data=1"]
    monkeypatch.chdir(project)
    val, out = {}, {}
    for argv in whole_way_commands():
        assert argv[0] == "diffjax", argv
        argv = [os.path.expanduser(a) for a in argv[1:]]  # what the shell does with ~/models/llama
        argv += sets(short) if argv[:2] == ["hf", "import"] else ["--workers", "1"] if argv[0] == "prepare" else \
            ["--json"] if argv[0] == "eval" else ["--no-progress"] if argv[0] == "train" else []
        capsys.readouterr()
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])
        out[argv[0]] = capsys.readouterr().out
        if argv[0] == "eval":
            val.setdefault(argv[2], []).append(json.loads(out["eval"])["validation"]["loss"])
    before, converted = val["runs/llama"][0], val["runs/llama-diff"][0]
    assert abs(converted - before) <= 1e-4 * before  # the conversion computes the Llama's function
    assert before < math.log(448) - 1  # pretrained: far below a fresh model's ln V
    first = min(losses(project / "runs" / "llama-diff"))
    assert abs(losses(project / "runs" / "llama-diff")[first] - before) < 0.5  # fine-tuning starts where it ended
    assert out["generate"].startswith("The history of")
    cfg, state, _ = load_run(project / "runs" / "llama-diff")
    assert json.loads((project / "runs" / "llama-diff" / "config.json").read_text())["data"]["tokenizer"] == "tokenizer"
    assert np.abs(np.asarray(layer_lambdas(state.params, cfg.model))).max() > 0
    tuned = project / "hf" / "llama-tuned"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tuned.iterdir()}

    # the same runs from another directory, and from inside runs/
    monkeypatch.chdir(elsewhere)
    llama, diff = "../project/runs/llama", "../project/runs/llama-diff"
    capsys.readouterr()
    assert main(["eval", "--workdir", diff, "--protocol", "validation", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["validation"]["loss"] == val["runs/llama-diff"][-1]
    assert main(["train", "--workdir", llama, "--no-progress", "--set", "train.steps=8",
                 "--allow-config-change"]) == 0
    assert main(["hf", "export", "--workdir", llama, "--out", "tuned-again"]) == 0
    assert (elsewhere / "tuned-again" / "tokenizer.json").is_file()
    monkeypatch.chdir(project / "runs")
    capsys.readouterr()
    assert main(["generate", "--workdir", "llama-diff", "--prompt", "the cat", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert main(["hf", "export", "--workdir", "llama-diff", "--out", "back"]) == 2
    assert "without it (a Llama converted with --as diff) has no Hugging Face class" in capsys.readouterr().err
    assert not (project / "runs" / "back").exists()


def test_lambda_lr_scale_scales_only_the_lambda_updates():
    """`optim.lambda_lr_scale`: the same gradients give the λ vectors' updates × the scale, everything else equal."""
    cfg, params = llama_to_diff(LLAMA, jax.tree.map(np.asarray, trained_diff(LLAMA)))
    base = OptimConfig(lr=1e-3, warmup_steps=0)
    plain, scaled = make_optimizer(base, 10), make_optimizer(dataclasses.replace(base, lambda_lr_scale=100.0), 10)

    @jax.jit  # both updates in one program (not an op at a time)
    def layer_1_updates(params):
        grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape), params)
        u_plain, _ = plain.update(grads, plain.init(params), params)
        u_scaled, _ = scaled.update(grads, scaled.init(params), params)
        return u_plain["layer_1"]["attn"], u_scaled["layer_1"]["attn"]

    attn_p, attn_s = layer_1_updates(params)
    for name in ("lambda_q1", "lambda_k2"):
        np.testing.assert_allclose(attn_s[name], 100 * attn_p[name], rtol=1e-6)
    np.testing.assert_array_equal(attn_s["wq"]["kernel"], attn_p["wq"]["kernel"])


def _with_ramp(params, cfg, value):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.full_like(x, value) if path[-1].key == "lambda_ramp" else x, params)


def test_the_forward_uses_the_ramp_times_lambda(rng):
    """With `model.lambda_ramp_steps` each layer's λ is multiplied by its `lambda_ramp` (sown as the λ the map
    uses): 0 hides A2 (the Llama's function), 1 is the un-ramped model's function."""
    llama = jax.tree.map(np.asarray, trained_diff(LLAMA, seed=int(rng.integers(1 << 30))))
    ramped = dataclasses.replace(LLAMA, lambda_ramp_steps=4)
    cfg, params = llama_to_diff(ramped, jax.tree.map(np.copy, llama), start="lambda-init")
    ids = rng.integers(0, LLAMA.vocab_size, (2, 16))
    assert rel_err(logits(cfg, params, ids), logits(LLAMA, llama, ids)) <= 1e-5
    half = jax.jit(sown_per_layer, static_argnums=0)(cfg, _with_ramp(params, cfg, 0.5), jnp.asarray(ids))
    lam = np.asarray(layer_lambdas(params, cfg))
    np.testing.assert_allclose([float(layer["attn"]["lambda"]) for layer in half], 0.5 * lam, rtol=1e-6)
    plain = dataclasses.replace(cfg, lambda_ramp_steps=0)
    unramped = jax.tree_util.tree_map_with_path(lambda p, x: x, params)
    for i in range(cfg.n_layers):
        del unramped[f"layer_{i}"]["attn"]["lambda_ramp"]
    full = logits(cfg, _with_ramp(params, cfg, 1.0), ids)
    assert rel_err(full, logits(plain, unramped, ids)) <= 1e-6 and rel_err(full, logits(LLAMA, llama, ids)) > 1e-3


RAMPED_RUN = ["model.lambda_ramp_steps=4", "train.steps=6", "train.checkpoint_every=2", "train.log_every=1",
              "train.eval_every=1000", "train.telemetry_every=0", "data.seq_len=32", "data.batch_size=2",
              "data.tasks=mqar", "data.mqar_pairs=4", "data.mqar_queries=4", "train.eval_batches=1",
              "optim.warmup_steps=0", "optim.lr=1e-3", "optim.lambda_lr_scale=100", "mesh.data=1",
              "train.keep_checkpoints=10"]


def test_a_ramped_run_resumes_exactly_and_each_checkpoint_holds_its_steps_ramp(tmp_path, monkeypatch, rng):
    """Stopped after step 3 and resumed, the run's losses from step 4 on equal an uninterrupted run's (the ramp
    continues at the step), and a checkpoint at step s computes with min(1, s / N)·λ (what eval reads)."""
    llama = jax.tree.map(np.asarray, trained_diff(LLAMA, seed=int(rng.integers(1 << 30))))
    for run in ("ref", "stopped"):
        import_run(None, tmp_path / run, RAMPED_RUN, as_arch="diff", start="lambda-init", model_cfg=LLAMA,
                   params=jax.tree.map(np.copy, llama))
    cfg, state, _ = load_run(tmp_path / "ref")  # the import's optimizer state: what tx.init makes
    fresh = jax.jit(make_optimizer(cfg.optim, cfg.train.steps).init)(state.params)
    assert jax.tree.structure(fresh) == jax.tree.structure(state.opt_state)
    pairs = zip(jax.tree.leaves(fresh), jax.tree.leaves(state.opt_state), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
    train(cfg, tmp_path / "ref", progress=False)
    with monkeypatch.context() as m:
        m.setenv(faults.ENV, "SIGTERM@3")
        assert train(cfg, tmp_path / "stopped", progress=False).interrupted
    train(cfg, tmp_path / "stopped", progress=False)
    assert_resumed_exactly(tmp_path / "ref", tmp_path / "stopped", killed_at=3, at_least=2)
    for step, ramp in ((0, 0.0), (2, 0.5), (6, 1.0)):
        _, params, _ = load_run(tmp_path / "stopped", step=step, params_only=True)
        assert {float(layer["attn"]["lambda_ramp"]) for layer in per_layer(params, cfg.model)} == {ramp}, step


def llama_checkpoint(path, family: str = "llama", dtype: str = "float32", **changes) -> Path:
    """A tiny random checkpoint that transformers makes (GQA 4/2, untied, weights away from init) in `path`."""
    import torch
    import transformers

    classes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    config = getattr(transformers, f"{classes[family]}Config")(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2, rope_theta=500.0,
        tie_word_embeddings=False, **changes)
    torch.manual_seed(0)
    model = getattr(transformers, f"{classes[family]}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 * (name.endswith("norm.weight")) + 0.1 * torch.randn_like(p))
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


@LIVE
@pytest.mark.parametrize("start", ["exact", "lambda-init", "axolotl", "paired"])
def test_each_start_is_the_checkpoints_function_at_step_0(tmp_path, start):
    """Every start, imported with the ramp, gives transformers' logits of the Llama at step 0 (exact also without
    the ramp); at full λ the others subtract A2 (λ = λ_init): axolotl's A2 from W_Q2 = W_K2 = 0, the paired one from
    the Llama's own heads (query head j with the same head of the next KV group)."""
    hf = llama_checkpoint(tmp_path / "llama")
    ids = np.arange(24).reshape(2, 12) * 7 % 512
    reference = transformers_logits(hf, ids)
    for ramp in (4, 0):
        cli_args = ["hf", "import", str(hf), "--as", "diff", "--start", start, "--workdir", str(tmp_path / f"r{ramp}"),
                    "--set", f"model.lambda_ramp_steps={ramp}", "--set", "data.tokenizer=byte"]
        assert main(cli_args) == 0
        cfg, state, _ = load_run(tmp_path / f"r{ramp}")
        err = rel_err(logits(cfg.model, state.params, ids), reference)
        assert (err <= 1e-5) == (ramp > 0 or start == "exact"), (ramp, err)
    lam = np.asarray(layer_lambdas(state.params, cfg.model))
    np.testing.assert_allclose(lam, 0.0 if start == "exact" else lambda_inits(cfg.model), atol=1e-6)
    attn, d = state.params["layer_1"]["attn"], cfg.model.head_dim
    q2 = attn["wq"]["kernel"].reshape(-1, 4, 2, d)[:, :, 1]
    q1 = attn["wq"]["kernel"].reshape(-1, 4, 2, d)[:, :, 0]
    assert (np.abs(q2).max() == 0) == (start == "axolotl")
    assert np.array_equal(q2, np.roll(q1, -2, axis=1)) == (start == "paired")


@LIVE
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_float16_checkpoint_computes_in_bfloat16_and_float16_is_refused(tmp_path, capsys, family):
    hf = llama_checkpoint(tmp_path / "ckpt", family, dtype="float16")
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "run"), "--set", "data.tokenizer=byte"]) == 0
    out = capsys.readouterr().out
    assert "computing in bfloat16 (the checkpoint stores float16: diffjax has no loss scaling)" in out, out
    assert run_config.load(tmp_path / "run").model.dtype == "bfloat16"
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "f16"), "--set", "data.tokenizer=byte",
                 "--set", "model.dtype=float16"]) == 2
    assert "model.dtype=float16: diffjax has no loss scaling" in capsys.readouterr().err


@LIVE
@pytest.mark.parametrize("family, sizes", [
    ("Llama", {}), ("Mistral", {"num_attention_heads": 16, "max_position_embeddings": 4096}),
    ("Qwen2", {"num_attention_heads": 32}), ("Qwen3", {"num_attention_heads": 32})])
def test_missing_config_keys_take_the_familys_transformers_defaults(family, sizes):
    """A config.json with only the sizes: diffjax fills in what transformers' own config class does (Mistral's 8 KV
    heads and 4,096 window, Qwen's 32 KV heads, Qwen3's head_dim 128)."""
    import transformers

    given = {"vocab_size": 96, "hidden_size": 256, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4} | sizes
    hf = getattr(transformers, f"{family}Config")(**given)
    cfg = model_config({"architectures": [f"{family}ForCausalLM"], **given})
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (cfg.kv_heads, cfg.head_dim, cfg.norm_eps, cfg.rope_theta, cfg.tie_embeddings) == (
        hf.num_key_value_heads, head_dim, hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.tie_word_embeddings)
    if family == "Mistral":  # its default window masks keys within a longer context: refused, by its value
        assert hf.sliding_window == 4096
        with pytest.raises(ConfigError, match="sliding_window=4096"):
            model_config({"architectures": ["MistralForCausalLM"], **given, "max_position_embeddings": 8192})

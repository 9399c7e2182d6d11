"""docs/design.md's architecture sketch (docs/sketches/my_arch.py; the conformance suite checks it as it checks every
registered arch) and the plain-path one (docs/sketches/my_xla_arch.py, `op=None`) through `diffjax train`,
`diffjax eval` and a sweep, the first shown whole by the docs and the second pointed to, its telemetry reading its own
logits; a protocol registered from this module alone through `diffjax eval --protocol`; a kernel registered by one
line, refusing for itself."""

import dataclasses
import functools
import importlib.util
import json
import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from fixtures.archs import registered
from helpers import MICRO, REPO, TINY, sets
from test_arch_conformance import SKETCH, TINY_RUN, TOLERANCE, load_sketch

from diffjax import checks, cli, kernels
from diffjax import config as config_lib
from diffjax import eval as eval_lib
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError
from diffjax.kernels import reference
from diffjax.model import DecoderLM, archs, param_count, per_layer
from diffjax.summary import attention_kernel
from diffjax.sweep.report import member_rows
from diffjax.sweep.runner import run_sweep
from diffjax.train.telemetry import attention_stats

# The finished MICRO run the run-safety and training tests evaluate too (conftest's `micro_run`: trained once)
SHARED_RUN = ("train.steps=4", "train.checkpoint_every=2")
PLAIN_SKETCH = "docs/sketches/my_xla_arch.py"  # an arch on the plain XLA path (op=None), which the docs point to


@functools.cache
def plain_sketch():
    """The plain-path sketch's module, imported once (unregistered: a test registers its `ARCH` in a registry copy)."""
    spec = importlib.util.spec_from_file_location("my_xla_arch_sketch", REPO / PLAIN_SKETCH)
    module = importlib.util.module_from_spec(spec)
    with registered():  # its `register` call lands in a throwaway copy
        spec.loader.exec_module(module)
    return module


def test_the_design_docs_show_the_sketch_as_it_is():
    """docs/design.md, "Extension points", shows docs/sketches/my_arch.py (which the conformance suite checks) whole,
    and it and the README point to the plain-path sketch."""
    code, design = (REPO / SKETCH).read_text(), (REPO / "docs/design.md").read_text()
    assert f"```python\n# {SKETCH} → diffjax/model/archs/my_arch.py\n{code}```" in design
    assert PLAIN_SKETCH in design.split("## Extension points")[1] and PLAIN_SKETCH in (REPO / "README.md").read_text()


def test_the_plain_path_sketch_is_described_by_its_own_logits(rng):
    """The plain-path sketch at temperatures off 1: telemetry's entropy and max |logit| are of τ_h · q kᵀ/√d
    (recomputed here from the sown q, k and the params' τ), and `quantization` refuses it in one line."""
    from test_telemetry import micro, numpy_stats, random_batch, random_params

    arch = plain_sketch().ARCH
    with registered(arch):
        cfg = micro(f"model.arch={arch.name}", "model.n_heads=2", "model.init_std=0.3")
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * rng.uniform(0.3, 3.0, x.shape) if "temperature" in jax.tree_util.keystr(path) else x,
            random_params(cfg, rng.integers(1 << 31)))
        batch = random_batch(cfg, rng)
        stats = jax.jit(lambda p, b: attention_stats(p, b, cfg=cfg))(params, batch)
        _, state = jax.jit(lambda p, b: DecoderLM(cfg.model).apply(
            {"params": p}, b["tokens"], b["positions"], b["segment_ids"], mutable=["intermediates"]))(params, batch)
        with pytest.raises(ConfigError, match=f"arch '{arch.name}' computes its attention itself"):
            eval_lib.get("quantization").run(cfg, params)
    unboxed = jax.tree.map(np.asarray, nn.meta.unbox(params))
    for i, layer in enumerate(per_layer(state["intermediates"], cfg.model)):
        q, k = (np.asarray(x, np.float64) for x in layer["attn"]["qk"][0])
        tau = unboxed[f"layer_{i}"]["attn"]["temperature"].astype(np.float64)
        assert np.ptp(tau) > 0.01  # off 1 and unequal: an untempered reader would differ
        logits = np.einsum("bthd,bshd->bhts", q, np.repeat(k, q.shape[2] // k.shape[2], 2)) / np.sqrt(q.shape[-1])
        for key, value in numpy_stats({"a": tau[:, None, None] * logits}, None, cfg.data.seq_len).items():
            np.testing.assert_allclose(float(stats[key][i]), value, rtol=2e-5, err_msg=f"{key} layer {i}")


@pytest.mark.slow  # end to end through the CLI
@pytest.mark.parametrize("sketch", [SKETCH, PLAIN_SKETCH])
def test_the_docs_sketch_trains_evaluates_and_joins_a_sweep(monkeypatch, tmp_path, capsys, sketch):
    """Each sketch's arch, registered, through `diffjax train`, `diffjax eval --protocol attention_noise` (its
    4-argument map) and a sweep where it joins as `baselines=`, matched in parameters to the DIFF row."""
    monkeypatch.setattr(archs, "_REGISTRY", dict(archs._REGISTRY))
    if sketch == SKETCH:
        name = load_sketch().ARCH.name
    else:
        name = archs.register(plain_sketch().ARCH).name
    run = tmp_path / "run"
    assert cli.main(["train", "--config", f"configs/small.py:size=tiny,arch={name}", "--workdir", str(run),
                     "--no-progress", *sets(TINY_RUN)]) == 0
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(run), "--protocol", "attention_noise", "--set", "eval.n=2",
                     "--set", "eval.depths=0.0,1.0", "--json"]) == 0
    shares = json.loads(capsys.readouterr().out)["attention_noise"]
    assert len(shares["answer"]) == 2 and all(0 <= x <= 1 for x in shares["answer"]), shares
    sweep = sweep_lib.load(f"configs/main.py:seeds=1,steps=2,baselines={name}")
    models = {m.variant: m.config.model for m in sweep.members}
    assert models[name].arch == name
    assert abs(param_count(models[name])["params"] / param_count(models["diff"])["params"] - 1) < TOLERANCE
    run_sweep(sweep, tmp_path / "sweep", progress=False)
    rows = member_rows(tmp_path / "sweep")
    assert sorted(r["variant"] for r in rows) == sorted(["diff", "transformer", name]), rows
    assert all(r["step"] == 2 and np.isfinite(r["val_loss"]) for r in rows), rows


@pytest.mark.slow  # end to end through the CLI
def test_a_toy_protocol_runs_from_the_cli(monkeypatch, micro_run, tmp_path, capsys):
    def count_params(cfg, params, *, scale: float = 1.0) -> dict:
        return {"n": scale * sum(x.size for x in jax.tree.leaves(params))}

    monkeypatch.setitem(eval_lib._REGISTRY, "toy_count", eval_lib.Protocol("toy_count", count_params))
    cfg = config_lib.load(TINY, [*MICRO, *SHARED_RUN])
    micro_run(tmp_path, *SHARED_RUN)  # a copy of that run, trained to step 4

    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "toy_count", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["toy_count"]["n"] == param_count(cfg.model)["params"]
    assert json.loads((tmp_path / "eval" / "toy_count.json").read_text()) == {"step": 4, "overrides": [],
                                                                              **printed["toy_count"]}
    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "all", "--json"]) == 0  # all that apply
    assert {"validation", "toy_count"} <= set(json.loads(capsys.readouterr().out))
    assert cli.main(["eval", "--workdir", str(tmp_path), "--protocol", "nope"]) == 2
    assert "unknown evaluation protocol 'nope'" in capsys.readouterr().err


def test_a_kernel_refuses_for_itself_and_the_user_reads_why(monkeypatch):
    """A kernel is its module's `Impl` and one line in `kernels.IMPLS`: each call it declares it cannot run is refused
    with its reason, which the config check and a named call show, and "auto" (taking it first where it runs) tries
    the next impl instead."""
    diff = checks.load("configs/small.py:size=tiny,arch=diff", ["model.dtype=bfloat16"])
    before = attention_kernel(diff, "gpu")
    refusal = {"now": "needs a toy GPU"}
    toy = kernels.Impl(diff_attention=reference.diff_attention, platforms=("gpu",), dtypes=("bfloat16",),
                       condition=lambda call: refusal["now"], auto=lambda call: True)
    monkeypatch.setattr(kernels, "IMPLS", {"toy": toy, **kernels.IMPLS})  # first in "auto"'s order
    assert attention_kernel(diff, "gpu") == before != "diff_attention: toy"
    with kernels.targeting("gpu"), pytest.raises(kernels.Unsupported, match="attention impl 'toy' needs a toy GPU"):
        kernels.resolve("toy", "diff_attention")
    refusal["now"] = None
    assert attention_kernel(diff, "gpu") == "diff_attention: toy"
    assert attention_kernel(diff, "cpu") == "diff_attention: xla"  # GPU only
    with kernels.targeting("gpu"), kernels.recording() as used:
        assert kernels.resolve("auto", "diff_attention", dtype="bfloat16") is reference.diff_attention
        with pytest.raises(kernels.Unsupported, match="attention impl 'toy' takes bfloat16 inputs, not float32"):
            kernels.resolve("toy", "diff_attention", dtype="float32")
    assert used == {"diff_attention": "toy"}
    assert checks.check(dataclasses.replace(diff, model=dataclasses.replace(diff.model, attention_impl="toy")))
    for spec, overrides, message in [
        ("arch=transformer", [], "model.attention_impl: impl 'toy' has no attention kernel, which arch 'transformer' "
                                 "needs"),
        ("arch=diff", ["mesh.context=2"], "model.attention_impl: 'toy' cannot run under context parallelism "
                                          "(mesh.context=2): it has no kernels for a block of a split sequence "
                                          "(diff_attention); use auto or xla or pallas or pallas_gpu or pallas_tpu")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            checks.load(f"configs/small.py:size=tiny,{spec}", ["model.attention_impl=toy", *overrides])
    kernels.IMPLS["toy"] = dataclasses.replace(toy, blocks=lambda interpret: None)  # with block kernels, it may
    assert checks.load("configs/small.py:size=tiny,arch=diff", ["model.attention_impl=toy", "mesh.context=2"])

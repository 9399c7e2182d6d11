"""diffjax/aot/profile.py — a compiled program's kernels with their FLOPs, HBM bytes and roofline times — on programs
compiled here for the CPU (whose HLO has the same structure: fusions, while loops with their trip counts,
dynamic slices), and experiments/step_profile.py end to end for a deviceless H100 (slow tier)."""

import dataclasses
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, cli_env, sets

from diffjax import config as config_lib
from diffjax import sharding
from diffjax.aot import profile
from diffjax.aot.compile import abstract_batch
from diffjax.train.optim import make_optimizer
from diffjax.train.state import state_shardings
from diffjax.train.step import jit_train_step


def _profile(fn, *args, **jit) -> profile.Profile:
    return profile.profile(jax.jit(fn, **jit).lower(*args).compile().as_text())


def _flops(found: profile.Profile) -> float:
    return sum(k.launches * k.flops for k in found.kernels)


def _array(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_a_matmul_is_2mnk_flops(rng):
    m, k, n = (int(x) for x in rng.integers(8, 200, size=3))
    found = _profile(lambda x, w: x @ w, _array(rng, m, k), _array(rng, k, n))
    assert _flops(found) == 2 * m * n * k
    assert [k.category for k in found.kernels if k.flops] == ["matmul"]


def test_a_convolution_is_2_flops_per_output_window_and_input_feature(rng):
    b, cin, cout, win = (int(x) for x in rng.integers(1, 9, size=4))
    hw = win + int(rng.integers(0, 9))
    x, w = _array(rng, b, hw, hw, cin), _array(rng, win, win, cin, cout)
    found = _profile(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")), x, w)
    out = hw - win + 1
    assert _flops(found) == 2 * (b * out * out * cout) * (win * win * cin)


def test_a_padded_strided_convolution_counts_what_xla_counts(rng):
    """Window positions in the padding do no work (XLA:TPU's windowed einsums pad half their windows): the count
    agrees with XLA's own cost analysis of the CPU program, the peer."""
    b, cin, cout, win, stride = (int(x) for x in rng.integers(1, 6, size=5))
    hw = win + int(rng.integers(2, 12))
    padding = [(int(rng.integers(0, win + 1)), int(rng.integers(0, win + 1))) for _ in range(2)]
    x, w = _array(rng, b, hw, hw + 1, cin), _array(rng, win, win, cin, cout)
    compiled = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))).lower(x, w).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert _flops(profile.profile(compiled.as_text())) == cost["flops"] > 0


def test_a_scan_launches_its_body_once_per_step(rng):
    """A scan's kernels run once per trip, a scan in a scan outer × inner times: the trip counts XLA writes."""
    outer, inner = (int(x) for x in rng.integers(2, 7, size=2))
    m, d = (int(x) for x in rng.integers(8, 64, size=2))

    def layers(h, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]

    def nested(h, ws):
        return jax.lax.scan(lambda h, w: (layers(h, w), None), h, ws)[0]

    once = _profile(layers, _array(rng, m, d), _array(rng, inner, d, d))
    assert [k.launches for k in once.kernels if k.flops] == [inner] and not once.unknown_trips
    assert _flops(once) == inner * 2 * m * d * d
    twice = _profile(nested, _array(rng, m, d), _array(rng, outer, inner, d, d))
    assert [k.launches for k in twice.kernels if k.flops] == [outer * inner]
    assert _flops(twice) == outer * inner * 2 * m * d * d


def test_a_loop_without_xlas_trip_count_is_read_from_its_counter(rng):
    """XLA:TPU writes no `known_trip_count`: the trip count comes from the loop's counter (start, step, bound); a
    loop whose count depends on data is counted once and named."""
    steps, m, d = int(rng.integers(2, 12)), *(int(x) for x in rng.integers(8, 64, size=2))
    compiled = jax.jit(lambda h, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]).lower(
        _array(rng, m, d), _array(rng, steps, d, d)).compile()
    text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", compiled.as_text())
    assert "known_trip_count" not in text
    found = profile.profile(text)
    assert [k.launches for k in found.kernels if k.flops] == [steps] and not found.unknown_trips

    def until(x, w):
        return jax.lax.while_loop(lambda x: x.sum() < 1e6, lambda x: jnp.abs(x @ w) + 1, x)

    data = profile.profile(jax.jit(until).lower(_array(rng, m, d), _array(rng, d, d)).compile().as_text())
    assert len(data.unknown_trips) == 1 and [k.launches for k in data.kernels if k.flops] == [1]


def test_a_fusion_moves_its_operands_and_its_result(rng):
    rows, cols = (int(x) for x in rng.integers(4, 300, size=2))
    a, b, c = _array(rng, rows, cols), _array(rng, rows, cols, dtype=jnp.bfloat16), _array(rng, cols)
    found = _profile(lambda a, b, c: a * b + c, a, b, c)
    (kernel,) = found.kernels
    assert kernel.op == "fusion" and kernel.flops == 0
    assert kernel.bytes == a.nbytes + b.nbytes + c.nbytes + rows * cols * 4  # the result: float32


def test_a_sliced_operand_is_read_as_its_slice_and_an_update_is_written_in_place(rng):
    """The scan's per-layer slice of a stacked array reads one layer, not the stack; an in-place update writes
    the update, not the array."""
    n, cols = (int(x) for x in rng.integers(3, 50, size=2))
    stack, i = _array(rng, n, cols), int(rng.integers(n))
    sliced = _profile(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False) * 2, stack, i)
    assert sum(k.bytes for k in sliced.kernels) == 4 * cols + 4 * cols + 4  # the row read, written; the index
    update = _array(rng, cols)
    written = _profile(lambda s, i, v: jax.lax.dynamic_update_index_in_dim(s, v * 2, i, 0), stack, i, update,
                       donate_argnums=0)
    assert sum(k.bytes for k in written.kernels) < stack.nbytes
    (dus,) = [k for k in written.kernels if "dynamic-update-slice" in k.name]
    assert dus.bytes >= 2 * update.nbytes and dus.bytes < 2 * update.nbytes + 16  # + the index (and a predicate)


def test_cudnn_attention_flops_come_from_its_shapes(rng):
    """A custom call has no cost analysis: flash attention's forward is 2·B·H·T·S·(d + d_v), halved when causal;
    its backward 2.5× that. The HLO as XLA:GPU writes the calls (trimmed to what is read)."""
    b, h = (int(x) for x in rng.integers(1, 5, size=2))
    t, d = (64 * int(x) for x in rng.integers(1, 5, size=2))
    q = f"bf16[{b},{t},{h},{d}]{{3,2,1,0}}"
    stats = f"f32[{b},{h},{t}]{{2,1,0}}"

    def call(name, target, result, operands, mask):
        config = {"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"dimensions": [str(x) for x in (
            b, h, t, t)]}, "mask_type": mask}}
        return (f"  %{name} = {result} custom-call({operands}), custom_call_target=\"{target}\", "
                f"metadata={{op_name=\"jit(f)/jvp(M)/attn/jit(attention)/dot_product_attention\"}}, "
                f"backend_config={json.dumps(config)}")

    text = "\n".join([
        "HloModule m", "", f"ENTRY %main (q: {q}, k: {q}, v: {q}, s: {stats}) -> {q} {{",
        *(f"  %{n} = {q} parameter({i})" for i, n in enumerate("qkv")), f"  %s = {stats} parameter(3)",
        call("fwd", "__cudnn$fmhaSoftmax", f"({q}, {stats}, u8[0]{{0}})", "%q, %k, %v", "CAUSAL"),
        call("full", "__cudnn$fmhaSoftmax", f"({q}, {stats}, u8[0]{{0}})", "%q, %k, %v", "NO_MASK"),
        call("bwd", "__cudnn$fmhaSoftmaxBackward", f"({q}, {q}, {q}, u8[16]{{0}})", "%q, %k, %v, %s, %q, %q",
             "CAUSAL"),
        f"  ROOT %out = {q} copy(%q)", "}"])
    kernels = {k.name: k for k in profile.profile(text).kernels}
    forward = 2 * b * h * t * t * (d + d)
    assert kernels["fwd"].flops == forward / 2 and kernels["full"].flops == forward
    assert kernels["bwd"].flops == 2.5 * forward / 2
    assert {kernels[n].category for n in ("fwd", "full", "bwd")} == {"attention"}
    size = b * t * h * d * 2
    assert kernels["fwd"].bytes == 3 * size + size + b * h * t * 4  # q, k, v in; out, stats out
    assert kernels["bwd"].bytes == 5 * size + b * h * t * 4 + 3 * size  # the byte scratch not counted


def test_roofline_is_the_slower_of_compute_and_memory(rng):
    h100, h200, v5e = profile.chip("h100"), profile.chip("h200"), profile.chip("v5e")
    assert (h100.flops, h100.hbm, h200.flops, h200.hbm, v5e.flops, v5e.hbm) == (989e12, 3.35e12, 989e12, 4.8e12,
                                                                                 197e12, 819e9)
    flops, nbytes = float(rng.uniform(1e9, 1e12)), float(rng.uniform(1e6, 1e9))
    k = profile.Kernel("k", "fusion", "kLoop", "matmul", "forward", "s", 3, flops, nbytes)
    assert k.roofline_s(h100) == max(flops / 989e12, nbytes / 3.35e12)
    assert k.bound(h100) == ("compute" if flops / 989e12 >= nbytes / 3.35e12 else "memory")
    assert profile.step_time([k], h100, 2e-6) == pytest.approx(3 * (k.roofline_s(h100) + 2e-6))
    with pytest.raises(ValueError, match="no peak"):
        profile.chip("z80")


def test_scope_and_phase_from_the_op_name():
    name = ("jit(train_step)/transpose(jvp(DecoderLM))/while/body/closed_call/layers/layers/checkpoint/"
            "rematted_computation/block/attn/jit(diff_attention)/dot_product_attention_fwd")
    assert profile.scope(name) == "layers/block/attn/diff_attention()" and profile.phase(name) == "recompute"
    backward = name.replace("rematted_computation/", "").replace("_fwd", "_bwd")
    assert profile.phase(backward) == "backward"
    assert profile.scope("jit(train_step)/jvp()/while/body/closed_call/dot_general") == "loss"
    assert profile.phase("jit(train_step)/jvp(DecoderLM)/while/body/closed_call/layers/block/mlp/w_up/dot") == \
        "forward"
    assert (profile.scope("jit(train_step)/jit(_where)/select_n"), profile.phase("jit(train_step)/mul")) == \
        ("optimizer/_where()", "optimizer")


def _step_profile(n_layers: int) -> profile.Profile:
    """The tiny DIFF model's train step (scanned layers, full remat) compiled for one of this host's CPU devices."""
    cfg = config_lib.load("configs/small.py:size=tiny,arch=diff", ["data.batch_size=8", "data.seq_len=32"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers, remat="full",
                                                             scan_layers=True)).validate()
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract, shards = state_shardings(cfg, mesh, tx)
    step = jit_train_step(cfg, tx, mesh, shards).lower(abstract, abstract_batch(cfg, mesh)).compile()
    return profile.profile(step.as_text())


@pytest.mark.slow
def test_a_train_steps_layer_work_scales_with_its_layers():
    """The scanned layers' kernels launch once per layer: their FLOPs at 3 layers are 3/2 of those at 2, the rest of
    the step's unchanged; full remat shows as a recompute phase (slow: two train steps compiled, ~30 s)."""
    two, three = _step_profile(2), _step_profile(3)

    def flops(found, in_layers: bool):
        return sum(k.launches * k.flops for k in found.kernels if k.scope.startswith("layers/") == in_layers)

    assert flops(two, True) > 0 and flops(three, True) == 1.5 * flops(two, True)
    assert flops(three, False) == flops(two, False) > 0  # the output head
    layer_flops = {p: sum(k.launches * k.flops for k in three.kernels if k.phase == p and k.scope.startswith(
        "layers/")) for p in ("forward", "recompute", "backward")}
    # the recompute stops at the last product the gradients need (the MLP's output is the next layer's saved input)
    assert 0 < layer_flops["recompute"] < layer_flops["forward"] < layer_flops["backward"]
    assert not three.unknown_trips


@pytest.mark.slow
def test_step_profile_reports_diff_against_the_transformer_for_an_h100(tmp_path):
    """The script end to end on the tiny model (scanned layers, full remat) for a deviceless H100: DIFF's cuDNN
    composition (4 flash calls per layer in each of forward, recompute and backward) against the Transformer's one,
    the FLOPs of each call from the model's shapes, the report's tables from the same kernels as kernels.json;
    `--reuse` re-reads the HLO."""
    t, batch, layers = 256, 8, 2
    overrides = [f"model.n_layers={layers}", "model.scan_layers=true", "model.remat=full", "model.dtype=bfloat16"]
    args = [sys.executable, "experiments/step_profile.py", "--config", "configs/small.py:size=tiny", "--seq-lens",
            str(t), "--batch", str(batch), *sets(overrides), "--out", str(tmp_path)]
    done = subprocess.run(args, cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    dump = json.loads((tmp_path / "kernels.json").read_text())[str(t)]["kernels"]
    cfg = config_lib.load("configs/small.py:size=tiny,arch=diff", [])
    h, d = cfg.model.n_heads, cfg.model.head_dim
    for arch, calls, heads in (("diff", 4, h), ("transformer", 1, 2 * h)):
        attention = [k for k in dump[arch] if k["kind"].startswith("__cudnn$fmha")]
        forward = [k for k in attention if not k["kind"].endswith("Backward")]
        assert len(forward) == 2 * calls and len(attention) == 3 * calls  # forward, recompute; backward
        assert {k["launches"] for k in attention} == {layers}
        assert {k["flops"] for k in forward} == {2 * batch * heads * t * t * 2 * d / 2}
    ms = sum(k["launches"] * profile.Kernel(**k).roofline_s(profile.chip("h200")) for k in dump["diff"])
    assert f"| diff | {len(dump['diff']):,} |" in report and f"| {ms * 1e3:.2f} |" in report
    assert "### What diff has that transformer does not" in report and "diff_attention()" in report
    again = subprocess.run([*args, "--reuse", "--chips", "h100"], cwd=REPO, env=cli_env(), capture_output=True,
                           text=True)
    assert again.returncode == 0 and "compiling" not in again.stderr and "at h100" in again.stdout

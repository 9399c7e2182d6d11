"""Compiled for the accelerator, on this CPU host: the fused kernels and the training step go through the target's
own compiler (libtpu's Mosaic and XLA:TPU; XLA:GPU with Triton and ptxas for sm_90/sm_80) on compile-only
devices. "Lowers" is not "compiles": these checks catch what a TPU or GPU would reject (operand precisions, tile
layouts, VMEM, partially manual shard_maps) — each one failed before its fix (docs/design.md §3)."""

import dataclasses
import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, cli_env
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import cli, kernels, sharding
from diffjax import config as config_lib
from diffjax.aot import targets
from diffjax.aot.compile import PARTS, compile_train_step, lower_train_step
from diffjax.kernels import mosaic_gpu, pallas_tpu, tpu_flash
from diffjax.kernels.pallas_gpu import diff_attention as gpu_diff_attention
from diffjax.model import archs


@pytest.fixture(autouse=True)
def _default_matmul_precision():
    """The suite asks for float32 matmuls everywhere (conftest); a bf16 model on a TPU runs at the default
    precision, and JAX's own flash kernel (tpu_flash) follows the global setting, which Mosaic refuses for bf16."""
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)
    yield
    jax.config.update("jax_default_matmul_precision", previous)


@functools.cache
def _one_device(target: str):
    """A one-device mesh of the target's compile-only devices."""
    return Mesh(np.array(targets.devices(targets.parse(target))[:1]), ("x",), axis_types=(AxisType.Auto,))


def _compile_grad(target, loss, *shapes):
    """Compile loss's value and gradients w.r.t. its float arguments for `target`; the compiled executable."""
    mesh = _one_device(target)
    rep = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep) for s in shapes]
    floats = tuple(i for i, s in enumerate(shapes) if jnp.issubdtype(s.dtype, jnp.floating))
    with jax.set_mesh(mesh), targets.uncached():  # newer JAX reads the target GPU from the context mesh (Triton)
        return jax.jit(jax.value_and_grad(loss, argnums=floats)).lower(*args).compile()


def _diff_shapes(dtype, t=256, h=4, kv=2, d=128):
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((1, t, kv, d), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((1, t, kv, 2 * d), jnp.dtype(dtype))
    return q, q, k, k, v, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32)


def _custom_calls(compiled, marker: str) -> int:
    return compiled.as_text().count(marker)


@pytest.mark.parametrize("target", ["v5e-4", "v4-8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("maps", [2, 1], ids=["diff", "standard"])
def test_mosaic_diff_kernel_compiles_for_tpu(target, dtype, maps):
    """Forward and backward (GQA, segment ids, causal) through Mosaic, DIFF's two maps and the standard op's one: bf16
    failed on every generation while the kernel asked for an fp32 contract precision on bf16 operands."""
    def loss(q1, q2, k1, k2, v, lam, seg):
        if maps == 1:
            return pallas_tpu.attention(q1, k1, v, causal=True, segment_ids=seg).astype(jnp.float32).sum()
        return pallas_tpu.diff_attention(q1, q2, k1, k2, v, lam, causal=True, segment_ids=seg).astype(
            jnp.float32).sum()

    compiled = _compile_grad(target, loss, *_diff_shapes(dtype))
    assert _custom_calls(compiled, "tpu_custom_call") == 3  # forward, dQ, dK/dV


def test_the_conformance_blocks_compile_for_tpu():
    """The mixed blocks the interpret-mode conformance tests use (tests/test_kernels.py) are valid TPU tiles too
    (segment ids are the strictest), so what those tests check is what a TPU can run."""
    from test_kernels import TPU_TEST_BLOCKS

    def loss(q1, q2, k1, k2, v, lam, seg):
        return pallas_tpu.diff_attention(q1, q2, k1, k2, v, lam, causal=True, segment_ids=seg,
                                         block_sizes=TPU_TEST_BLOCKS).sum()

    compiled = _compile_grad("v5e-4", loss, *_diff_shapes("float32", d=64))
    assert _custom_calls(compiled, "tpu_custom_call") == 3


def test_the_compiler_counts_the_kernels_flops():
    """XLA sees each fused kernel's cost (a custom call is otherwise free to its scheduler and cost_analysis):
    the causal forward at T = 1024, 4 heads, d = 128, e = 2d does 2 maps × (QKᵀ + PV) over half the pairs."""
    b, t, h, d = 1, 1024, 4, 128
    rep = NamedSharding(_one_device("v5e-4"), P())
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for s in [(b, t, h, d)] * 4 + [(b, t, h, 2 * d)]]
    forward = functools.partial(pallas_tpu.diff_attention, causal=True)
    with targets.uncached():
        compiled = jax.jit(forward).lower(*shapes, jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    pairs = b * h * t * t / 2
    assert analysis["flops"] == pytest.approx(2 * pairs * (2 * d + 2 * 2 * d) * 2, rel=0.01)


@pytest.mark.slow
def test_mosaic_compile_checks_vmem():
    """The compile is real: 2048 × 512 bf16 blocks (query rows × keys) exceed the scoped VMEM of a v5e core; 2048 × 128
    ones fit. The forward kernel alone shows it (the backward's, compiled too, doubled the time); 512 keys, not 2048:
    Mosaic's compile time grows with the block (2 cores: 58 s at 2048 × 2048, 19 s at 2048 × 512)."""
    big = pallas_tpu.BlockSizes(*[2048, 512] * 3)
    shapes = _diff_shapes("bfloat16", t=2048)
    mesh = _one_device("v5e-4")
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())) for s in shapes]

    def forward(q1, q2, k1, k2, v, lam, seg):
        return pallas_tpu.diff_attention(q1, q2, k1, k2, v, lam, causal=True, segment_ids=seg, block_sizes=big)

    with pytest.raises(Exception, match="CompileTimeScopedVmemOom"), jax.set_mesh(mesh), targets.uncached():
        jax.jit(forward).lower(*args).compile()


@pytest.mark.parametrize("target", ["v5e-4", "v6e-4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tpu_flash_compiles_for_tpu(target, dtype):
    q, _, k, _, _, _, seg = _diff_shapes(dtype)

    def loss(q, k, v, seg):
        return tpu_flash.attention(q, k, v, causal=True, segment_ids=seg).astype(jnp.float32).sum()

    compiled = _compile_grad(target, loss, q, k, k, seg)
    assert _custom_calls(compiled, "tpu_custom_call") >= 2  # the forward and the backward kernels


@pytest.mark.parametrize("dtype,segments", [("bfloat16", True), ("float32", False)])
def test_triton_diff_kernel_compiles_for_h100(dtype, segments):
    """Forward + backward through Triton to sm_90a cubins (ptxas), ragged length 200, GQA."""
    q1, q2, k1, k2, v, lam, seg = _diff_shapes(dtype, t=200)

    def loss(q1, q2, k1, k2, v, lam, *seg):
        return gpu_diff_attention(q1, q2, k1, k2, v, lam, causal=True, segment_ids=seg[0] if seg else None).astype(
            jnp.float32).sum()

    compiled = _compile_grad("h100x1", loss, q1, q2, k1, k2, v, lam, *([seg] if segments else []))
    assert _custom_calls(compiled, "__triton") + _custom_calls(compiled, "triton") >= 3


@pytest.mark.skipif(not mosaic_gpu.available(), reason=f"the Mosaic GPU kernels need jax >= 0.11 ({jax.__version__})")
@pytest.mark.all_cases  # only the newest-JAX run has a jax that runs it: (128, 2), the refusal, runs nowhere else
@pytest.mark.parametrize("d,maps", [(64, 2), (128, 2), (128, 1)])
def test_mosaic_gpu_kernels_compile_for_h100(d, maps):
    """Forward + backward through Mosaic GPU to sm_90a cubins (ptxas), at the default tiles: ragged length 200, GQA,
    packed documents. The compile checks shared memory: two warpgroups at d = 128 are refused (277 KiB > 227)."""
    q1, q2, k1, k2, v, lam, seg = _diff_shapes("bfloat16", t=200, d=d)

    def loss(*args):
        *tensors, seg = args
        out = (mosaic_gpu.diff_attention if maps == 2 else mosaic_gpu.attention)(*tensors, causal=True, segment_ids=seg)
        return out.astype(jnp.float32).sum()

    shapes = (q1, q2, k1, k2, v, lam, seg) if maps == 2 else (q1, k1, v, seg)
    compiled = _compile_grad("h100x1", loss, *shapes)
    assert _custom_calls(compiled, "mosaic_gpu") >= 3
    if d == 128 and maps == 2:
        two_warpgroups = mosaic_gpu.BlockSizes(compute_wgs=2)
        with pytest.raises(Exception, match="exceeds available shared memory"):
            _compile_grad("h100x1", lambda *a: mosaic_gpu.diff_attention(*a[:-1], causal=True, segment_ids=a[-1],
                                                                         block_sizes=two_warpgroups).sum(), *shapes)


def _tiny(arch: str, impl: str = "auto", **model) -> config_lib.Config:
    """The tiny config with one layer (each layer compiles the same program; two only took longer)."""
    cfg = config_lib.load(f"configs/small.py:size=tiny,arch={arch}",
                          [f"model.attention_impl={impl}", "model.dtype=bfloat16", "data.batch_size=8",
                           "data.seq_len=256"])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{"n_layers": 1, **model})).validate()


@pytest.mark.parametrize("arch,kernel,named", [("diff", "pallas", True), ("transformer", "tpu_flash", False)])
def test_train_step_compiles_for_a_v5e_slice_with_data_and_fsdp(arch, kernel, named):
    """The exact `diffjax train` step on a 4-chip v5e mesh (data 2 × fsdp 2): the kernels are chosen for the TPU
    although this host is a CPU, and they sit in a fully manual shard_map (Mosaic refuses partially manual ones).
    With `named`, the kernel asked for by name (impl=KERNEL) lowers to the very program auto's choice does, so one
    compile (a target's is not cached: it is most of this test's time) checks both."""
    def config(impl):
        cfg = _tiny(arch, impl, remat="dots", loss_chunk=128)
        return dataclasses.replace(cfg, mesh=config_lib.MeshConfig(data=2, fsdp=2, tensor=1))

    op, v5e = archs.get(arch).op, targets.parse("v5e-4")
    if named:
        by_name, auto = lower_train_step(config(kernel), v5e), lower_train_step(config("auto"), v5e)
        assert by_name.kernels == {op: kernel} and by_name.step.as_text() == auto.step.as_text()
    report = compile_train_step(config("auto"), v5e)
    assert report.kernels == {op: kernel}
    assert report.fits and report.mesh == {"sweep": 1, "data": 2, "fsdp": 2, "context": 1, "tensor": 1}
    assert 0 < report.memory["parameters"] < report.memory["total"] < report.memory["capacity"]
    assert sum(report.memory[k] for k in PARTS) == report.memory["total"]  # every part listed
    assert min(report.memory[k] for k in PARTS) >= 0 and report.memory["generated code"] > 0


@pytest.mark.parametrize("arch,strategy", [("diff", "ring"), ("transformer", "all_gather")])
@pytest.mark.slow
def test_train_step_compiles_for_a_v5e_slice_with_context_parallelism(arch, strategy):
    """The sequence split over `context` (fsdp 2 × context 2) compiles for TPU: the split attention's collectives
    (all-gather, or the ring's collective permutes and its custom VJP) inside the fully manual shard_map, every block
    through the Mosaic kernels (Mosaic checks their tiling): DIFF's two maps, the baseline's one."""
    cfg = dataclasses.replace(_tiny(arch, remat="full", loss_chunk=64, context_strategy=strategy),
                              mesh=config_lib.MeshConfig(data=1, fsdp=2, context=2))
    report = compile_train_step(cfg, targets.parse("v5e-4"))
    op = "attention" if arch == "transformer" else "diff_attention"
    assert report.kernels == {op: f"pallas blocks ({strategy} over context)"}
    assert report.fits and report.mesh == {"sweep": 1, "data": 1, "fsdp": 2, "context": 2, "tensor": 1}


RING_BLOCKS = "pallas blocks (ring over context)"


@pytest.mark.parametrize("arch,op,kernel,context", [("diff", "diff_attention", "cudnn", 1),
                                                    ("transformer", "attention", "cudnn", 1),
                                                    ("diff", "diff_attention", RING_BLOCKS, 2),
                                                    ("transformer", "attention", RING_BLOCKS, 2)])
@pytest.mark.slow
def test_train_step_compiles_for_an_h100_node(arch, op, kernel, context):
    """4 × H100 (data 2 × fsdp 2): DIFF through cuDNN's composition and the baseline through cuDNN (auto's bf16
    choice on a GPU); with the sequence split (fsdp 2 × context 2), both ops' ring blocks through the Triton kernels
    (two maps, one; sm_90a cubins)."""
    cfg = dataclasses.replace(_tiny(arch, context_strategy="ring", **({"loss_chunk": 64} if context > 1 else {})),
                              mesh=config_lib.MeshConfig(data=4 // (2 * context), fsdp=2, context=context, tensor=1))
    report = compile_train_step(cfg, targets.parse("h100x4"))
    assert report.kernels == {op: kernel} and report.fits
    assert report.device_kind.startswith("NVIDIA H100")


@pytest.mark.slow
def test_flashdiffattn_1_calls_cudnn_once_per_map_for_an_h100():
    """impl=cudnn_wide_v: DIFF's step calls cuDNN twice forward and twice backward (V of width 2d, each softmax once)
    where the four-call composition calls it four times each way; compiled on this host for an H100, whose compute
    capability answers cuDNN's Hopper check (`targets.capability_of`)."""
    calls = {}
    for impl in ("cudnn", "cudnn_wide_v"):
        lowered = lower_train_step(_tiny("diff", impl), targets.parse("h100x1"))
        assert lowered.kernels == {"diff_attention": impl}
        with targets.uncached():
            hlo = lowered.step.compile().as_text()
        fmha = re.findall(r'custom_call_target="__cudnn\$fmha(\w*)"', hlo)  # ScaleBiasSoftmax: packed documents
        calls[impl] = [sum(not t.endswith("Backward") for t in fmha), sum(t.endswith("Backward") for t in fmha)]
    assert calls == {"cudnn": [4, 4], "cudnn_wide_v": [2, 2]}


@pytest.mark.parametrize("arch,calls", [("diff", 4), ("transformer", 1)])
@pytest.mark.slow
def test_keeping_attention_for_the_backward_runs_its_forward_once_for_an_h100(arch, calls):
    """model.remat=attention: the step calls cuDNN's forward once per call of the model (DIFF's four-call form: 4 a
    layer, the Transformer: 1), where full remat calls it twice as often (recomputed in the backward pass)."""
    forward = {}
    for remat in ("full", "attention"):
        lowered = lower_train_step(_tiny(arch, "cudnn", remat=remat), targets.parse("h100x1"))
        with targets.uncached():
            hlo = lowered.step.compile().as_text()
        forward[remat] = len(re.findall(r'custom_call_target="__cudnn\$fmha\w*Softmax"', hlo))
    assert forward == {"full": 2 * calls, "attention": calls}


def _loop_bodies_with_sends(hlo: str) -> list[list[str]]:
    """Per computation of the compiled HLO that starts a collective permute and runs a conditional (the ring's loop
    bodies: the block kernels are chosen by `lax.switch`), its collective-permute start/done and conditional ops in
    schedule order."""
    bodies = []
    for computation in re.split(r"\n(?=\S.*\{\n)", hlo):
        ops = re.findall(r" (collective-permute-start|collective-permute-done|conditional)\(", computation)
        if computation.startswith("ENTRY") or "collective-permute-start" not in ops or "conditional" not in ops:
            continue
        bodies.append(ops)
    return bodies


def test_the_ring_sends_each_block_while_its_kernels_run():
    """The ring's sends share no data with the step's compute (`context_parallel._Ring`), so the GPU schedule starts
    the collective permute before the block kernels and waits for it after them, in the forward loop and in the
    backward's (where a block's gradients travel one step behind it: sent with them after the compute, the combined
    permute waited for the kernels)."""
    from diffjax.kernels import context_parallel as split_kernels

    mesh = Mesh(np.array(targets.devices(targets.parse("h100x4"))), ("context",), axis_types=(AxisType.Auto,))
    split = NamedSharding(mesh, P(None, "context"))
    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16, sharding=split)
    seg = jax.ShapeDtypeStruct((1, 512), jnp.int32, sharding=split)
    index = jax.ShapeDtypeStruct((512,), jnp.int32, sharding=NamedSharding(mesh, P("context")))

    def loss(q, k, v, seg, index):
        op = functools.partial(split_kernels.attention, axis_name="context", strategy="ring", impl="pallas")
        out = jax.shard_map(lambda q, k, v, s, i: op(q, k, v, index=i, segment_ids=s), mesh=mesh,
                            in_specs=(P(None, "context"),) * 4 + (P("context"),), out_specs=P(None, "context"),
                            check_vma=False)(q, k, v, seg, index)
        return out.astype(jnp.float32).sum()

    with kernels.targeting("gpu"), jax.set_mesh(mesh), targets.uncached():
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg, index).compile().as_text()
    bodies = _loop_bodies_with_sends(hlo)
    assert len(bodies) == 2, bodies  # the forward's loop and the backward's
    for ops in bodies:
        assert ops.index("collective-permute-start") < ops.index("conditional") < (
            len(ops) - 1 - ops[::-1].index("collective-permute-done")), ops


def test_the_host_backend_still_picks_the_reference():
    """Outside a target's mesh nothing changes on this CPU host: "auto" is the XLA reference."""
    assert kernels.platform() == "cpu"
    with kernels.recording() as used:
        kernels.resolve("auto", "diff_attention")
    assert used == {"diff_attention": "xla"}
    with kernels.targeting("cuda"):
        assert kernels.platform() == "gpu"


def _compile_cli(capsys, *args) -> tuple[int, str]:
    code = cli.main(["compile", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_compile_refuses_a_layout_that_does_not_fit(capsys):
    """Full logits of a 100k vocabulary for 64 × 2048 tokens per chip (the loss unchunked: loss_chunk = seq_len)
    cannot fit a v5e's 16 GiB: exit 3, a plain sentence naming the biggest part and what to try. One layer: the
    logits are the temporaries whatever the depth, and a second layer only compiled the same block again."""
    code, out = _compile_cli(capsys, "--config", "configs/small.py:size=tiny,arch=diff", "--target", "v5e-4",
                             "--set", "model.n_layers=1",
                             "--set", "model.vocab_size=100288", "--set", "data.batch_size=256",
                             "--set", "data.seq_len=2048", "--set", "model.dtype=bfloat16",
                             "--set", "model.loss_chunk=2048")
    assert code == cli.EXIT_DOES_NOT_FIT, out
    assert "does not fit" in out and "biggest part is temporaries" in out and "model.loss_chunk" in out


def test_compile_bad_target_and_mesh_exit_2(capsys):
    code, out = _compile_cli(capsys, "--config", "configs/small.py:size=tiny,arch=diff", "--target", "v5e-17")
    assert code == 2 and "unknown target 'v5e-17'" in out and "v5e-16" in out and "h100x8" in out
    code, out = _compile_cli(capsys, "--config", "configs/small.py:size=tiny,arch=diff", "--target", "v5e-4",
                             "--set", "mesh.data=8")
    assert code == 2 and "does not match v5e-4's 4 devices" in out


def test_compile_prints_its_error_and_no_plugin_logging():
    """As a user's shell runs it (a fresh process, JAX_PLATFORMS unset, libtpu and the CUDA plugin installed):
    the refusal is the only line on stderr — not the CUDA plugin's "Could not find cuda drivers" nor libtpu's
    worker-hostname errors, both printed from C++ while the target's topology is built."""
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-m", "diffjax.cli", "compile", "--config",
                          "configs/small.py:size=tiny,arch=diff", "--target", "v5e-4", "--set", "mesh.data=8"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert "does not match v5e-4's 4 devices" in out.stderr


def test_multislice_spans_slices_with_data_parallelism(capsys):
    """Two v5e-4 slices: `data` runs across the slices (over the data-center network), fsdp within each slice."""
    devices = targets.devices(targets.parse("v5e-4", num_slices=2))
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=2, fsdp=-1), devices)
    slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)  # [sweep, data, fsdp, tensor]
    assert (slice_of[0, 0] == 0).all() and (slice_of[0, 1] == 1).all()
    code, out = _compile_cli(capsys, "--config", "configs/small.py:size=tiny,arch=diff", "--target", "v5e-4",
                             "--num-slices", "2", "--set", "mesh.data=1", "--set", "mesh.fsdp=-1")
    assert code == 2 and "mesh.data: 1 must be a multiple of the 2 slices" in out


def test_target_names():
    assert targets.parse("v5e-16").topology == "v5e:4x4"
    assert targets.parse("v4-8").topology == "v4:2x2x1" and targets.parse("v4-8").megacore
    assert targets.parse("v5p-16").topology == "v5:2x2x2"
    assert len(targets.devices(targets.parse("v5p-16"))) == 8  # 16 TensorCores = 8 megacore chips
    assert len(targets.devices(targets.parse("v5e-4", num_slices=2))) == 8
    assert len(targets.devices(targets.parse("h100x8", num_slices=2))) == 16

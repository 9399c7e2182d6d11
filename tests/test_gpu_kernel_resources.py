"""The fused Triton kernels (kernels/pallas_gpu.py) keep their working set in registers: compiled for an H100 (sm_90a)
and an A100 (sm_80) on this CPU host (deviceless, through XLA's Triton pipeline) and run through `ptxas -v`, no kernel
of a shipped configuration spills (docs/kernels.md, "Registers and spills"). Each spill is a round trip to local
memory inside the kernel's inner loop; the defaults before this check spilled up to 2.3 KB per thread on sm_90a."""


import jax
import jax.numpy as jnp
import kernel_resources as kr
import numpy as np
import pytest

from diffjax.aot import targets
from diffjax.kernels import pallas_gpu


@pytest.fixture(scope="module")
def measurer():
    ptxas = kr.find_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (pip install nvidia-cuda-nvcc-cu12)")
    try:
        for target in kr.ARCH_TARGET.values():
            targets.devices(targets.parse(target))
    except targets.TargetUnavailable as e:
        pytest.skip(str(e))
    return kr.Measurer(ptxas)


MMA = {"sm_90a": "wgmma", "sm_80": "mma.sync"}


@pytest.mark.parametrize("arch,d,dtype,causal,segments,maps", [
    ("sm_90a", 64, "bfloat16", True, True, 2),
    ("sm_90a", 128, "bfloat16", True, True, 2),
    ("sm_90a", 96, "float16", False, False, 2),
    ("sm_80", 64, "bfloat16", True, True, 2),
    ("sm_80", 128, "bfloat16", True, True, 2),
    ("sm_90a", 128, "bfloat16", True, True, 1),  # the standard op's one-map kernels (the baseline's head dim)
    ("sm_80", 128, "bfloat16", False, True, 1),
])
def test_default_kernels_do_not_spill(measurer, arch, d, dtype, causal, segments, maps):
    """Training (forward with residuals, dQ, dK/dV) and inference forward at T = 2048, GQA (4 query heads, 2 kv)."""
    rows = measurer.measure(kr.Case(arch, d, dtype, causal=causal, segments=segments, t=2048, h=4, kv=2, maps=maps))
    assert [r["kernel"] for r in rows] == ["fwd (train)", "bwd dq", "bwd dkv", "fwd (infer)"], rows
    assert not kr.spills(rows), "spills:\n" + kr.markdown(kr.spills(rows))
    assert not kr.over_smem(rows), kr.markdown(kr.over_smem(rows))
    defaults = pallas_gpu.BlockSizes.get_default(d, dtype, arch)
    assert {r["num_warps"] for r in rows} == {defaults.num_warps}  # the kernels ran with get_default's settings
    # Hopper's tiles keep ≥ 64 MMA rows, so Triton emits warpgroup MMAs (tensor cores at full rate), not mma.sync
    assert {r["mma"] for r in rows} == {MMA[arch]}, kr.markdown(rows)


def test_defaults_follow_the_target_gpu():
    """A deviceless compile for an A100 (`jax.set_mesh` on its compile-only devices) gets A100's tiles, one for an
    H100 Hopper's; without a GPU in sight, Hopper's (as JAX's Triton lowering assumes)."""
    try:
        a100 = targets.devices(targets.parse("a100x1"))[:1]
    except targets.TargetUnavailable as e:
        pytest.skip(str(e))
    seen = []

    def trace(x):
        seen.append(pallas_gpu.target_arch())
        return x

    with jax.set_mesh(jax.sharding.Mesh(np.array(a100), ("x",))):
        jax.jit(trace).trace(jax.ShapeDtypeStruct((2,), jnp.float32))
    jax.jit(trace).trace(jax.ShapeDtypeStruct((3,), jnp.float32))  # no mesh; this host's backend is the CPU
    assert seen == ["8.0", None]
    get = pallas_gpu.BlockSizes.get_default
    assert get(128, jnp.bfloat16, "8.0") == get(96, jnp.float16, "sm_80") != get(128, jnp.bfloat16, "9.0")
    assert get(128, jnp.bfloat16, None) == get(128, jnp.bfloat16, "sm_90a") == get(128, jnp.bfloat16, "10.0")
    assert get(64, jnp.bfloat16, "8.6") == get(64, jnp.bfloat16, "8.0")

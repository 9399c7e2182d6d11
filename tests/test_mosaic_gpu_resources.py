"""The Mosaic GPU kernels at their default tiles, compiled deviceless for an H100 (ptxas's report through
experiments/mosaic_gpu_resources.py): no register spills, shared memory within the GPU's, and the matmul work the
kernels execute per DIFF attention against the arithmetic's (docs/kernels.md, "The Mosaic GPU kernel")."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import pytest

from diffjax.kernels import mosaic_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import mosaic_gpu_resources as resources  # noqa: E402

pytestmark = pytest.mark.skipif(not mosaic_gpu.available(),
                                reason=f"the Mosaic GPU kernels need jax >= 0.11 ({jax.__version__})")


@functools.cache
def _measured(d: int, maps: int) -> list[dict]:
    """The training step's kernels, causal with packed documents, GQA, T = 2048 (one compile per worker)."""
    return resources.measure(dict(d=d, maps=maps, causal=True, segments=True, t=2048, heads=4, kv_heads=2, blocks={}))


@pytest.mark.parametrize("d,maps", [(64, 2), (128, 2), (128, 1)], ids=["diff_d64", "diff_d128", "standard_d128"])
def test_default_tiles_spill_nothing(d: int, maps: int):
    """Every kernel of the training step (forward, dQ, dK/dV), causal with packed documents, GQA."""
    rows = _measured(d, maps)
    assert "error" not in rows[0], rows[0]
    dq_apart = mosaic_gpu.BlockSizes.get_default(d).dkv != "fused"
    assert {r["kernel"].removeprefix("diff_") for r in rows} == {"fwd", "dkv"} | ({"dq"} if dq_apart else set())
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["smem"] <= resources.SMEM_LIMIT, r


def test_executed_work_against_the_arithmetic():
    """DIFF: at d = 64 the arithmetic's 12 + 20 units (dQ formed in the dK/dV kernel); at d = 128 the forward's 12
    (the logits once, V in one launch), the backward the dQ kernel's 12 and the dK/dV kernel's 16 against the 20 the
    math needs (S and dP formed in both: dQ's tiles do not fit beside the dK/dV kernel's)."""
    assert resources.work(_measured(64, 2)) | {"ratio": None} == dict(forward=12, backward=20, ratio=None,
                                                                        arithmetic=(12, 20))
    work = resources.work(_measured(128, 2))
    assert work["forward"] == 12 and work["backward"] == 28


def test_the_split_by_map_compiles_at_a_padded_head_dim():
    """d = 32 is zero-padded to 64, and V (2d = 64 wide) to 128: split by map, each warpgroup writes whole 64-column
    tiles of V (halves of 32 left Mosaic no layout to infer, and the device check's candidate failed to compile)."""
    blocks = dict(forward="maps", dq="maps", dkv="pair")
    rows = resources.measure(dict(d=32, maps=2, causal=True, segments=True, t=128, heads=2, kv_heads=1, blocks=blocks))
    assert "error" not in rows[0], rows[0]
    assert {r["kernel"] for r in rows} == {"diff_fwd", "diff_dq", "diff_dkv"}


def test_dq_in_the_dkv_kernel_fits_at_d128_and_does_the_arithmetics_work():
    """The d = 128 candidate with dQ formed in the dK/dV kernel: its tiles within an H100 block's shared memory (P in
    16 bits, dS through P's tile, dQ in 64-column halves: 262 KiB otherwise), and 12 + 20 units, the arithmetic's."""
    blocks = vars(mosaic_gpu.candidates(128)["maps, dq in dkv"])
    rows = resources.measure(dict(d=128, maps=2, causal=True, segments=True, t=2048, heads=4, kv_heads=2,
                                  blocks=blocks))
    assert "error" not in rows[0], rows[0]
    assert {r["kernel"] for r in rows} == {"diff_fwd", "diff_dkv"}
    assert all(r["smem"] <= resources.SMEM_LIMIT for r in rows), rows
    assert resources.work(rows) | {"ratio": None} == dict(forward=12, backward=20, ratio=None, arithmetic=(12, 20))

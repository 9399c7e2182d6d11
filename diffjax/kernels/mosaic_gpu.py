"""Fused differential flash attention on Pallas' Mosaic GPU backend (Hopper, sm_90a; docs/kernels.md, "The Mosaic
GPU kernel"): the algorithm of `pallas_gpu.py` written for warpgroups — TMA loads, `wgmma`, a memory warpgroup
feeding two compute warpgroups through pipelined K/V (or Q/dO) stages (`plgpu.emit_pipeline_warp_specialized`).

    out = (softmax(s·q1 k1ᵀ) − λ·softmax(s·q2 k2ᵀ)) v,   s = 1/√d

The kernels: `mosaic_gpu_forward.py` (both online softmaxes in one pass, the float32 epilogue `acc1/l1 − λ·acc2/l2`)
and `mosaic_gpu_backward.py` (dQ and dK/dV, or up to d = 64 dQ formed in the dK/dV kernel), on what
`mosaic_gpu_common.py` gives both: a launch that hands a kernel its refs and scratch by name. This module: when they
run (`available`), their tiles (`BlockSizes`, `candidates`, the device check's `tuned` table) and the public ops. The
standard op is the same kernels with one map. bf16/fp16 only (wgmma); float32 stays on the Triton and XLA paths.

Each kernel splits its work between two compute warpgroups by rows, by map (forward, dQ) or by output (dK/dV):
`BlockSizes`, `candidates`. On a GPU the wgmma accumulates in place and takes P and dS from registers; the interpret
mode that runs the kernels on a CPU (`plgpu.InterpretGPUParams`) takes operands from shared memory only, so there
they are staged (`mosaic_gpu_common.accumulate`, the one difference), and the device check's conformance checks the
GPU path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from diffjax.kernels.common import public_ops
from diffjax.kernels.fused_vjp import fused_attention
from diffjax.kernels.impl import Impl
from diffjax.kernels.mosaic_gpu_backward import backward
from diffjax.kernels.mosaic_gpu_common import plgpu
from diffjax.kernels.mosaic_gpu_forward import forward

_WGMMA_ROWS = 64  # a warpgroup's wgmma tile has 64 rows


def available() -> bool:
    """Whether this JAX runs the kernels: Mosaic GPU with the warp-specialized pipeline, from jax 0.11 (the GPU image's;
    jax 0.10's interpreter cannot load a shared-memory vector into registers, so nothing checks them there)."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    return plgpu is not None and hasattr(plgpu, "emit_pipeline_warp_specialized") and version >= (0, 11)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: query rows per compute warpgroup (`block_q`, forward and dQ) against `block_k` key rows per pipeline
    step; key rows per compute warpgroup (`block_k_dkv`) against `block_q_dkv` query rows per step (dK/dV). Each is
    a multiple of 64 (a warpgroup's wgmma has 64 rows; a 64-wide bf16 row is one 128-byte swizzle). `stages`: K/V
    tiles in flight. `v_chunk`: V columns one forward launch computes (two float32 [block_q, v_chunk] accumulators
    must fit a thread's registers); `dkv_split`: dK and dV in separate launches when V is wider than this."""

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    stages: int = 2
    compute_wgs: int = 2
    v_chunk: int = 128
    forward: str = "rows"
    dq: str = "rows"
    dkv: str = "rows"

    head_multiple = 64  # head dims are zero-padded to a multiple of this (`common.prepare`)

    def value_multiple(self, maps: int) -> int:
        """V's head dim is zero-padded to a multiple of this: split by map, each warpgroup writes half of V's
        columns, which must be whole 64-column tiles (a padded d < 64's 32 leave Mosaic no layout to infer)."""
        return 2 * self.head_multiple if maps == 2 and self.forward == "maps" else self.head_multiple

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "v_chunk"):
            value = getattr(self, f)
            if not isinstance(value, int) or value <= 0 or value % _WGMMA_ROWS:
                raise ValueError(f"mosaic_gpu.BlockSizes.{f} must be a positive multiple of 64, got {value!r}")
        if {self.forward, self.dq} - {"rows", "maps"} or self.dkv not in ("rows", "split", "pair", "fused"):
            raise ValueError(f"mosaic_gpu.BlockSizes: forward and dq are 'rows' or 'maps', dkv 'rows', 'split', "
                             f"'pair' or 'fused'; got {self.forward!r}, {self.dq!r}, {self.dkv!r}")
        if self.stages < 2 or self.compute_wgs not in (1, 2):
            raise ValueError(f"mosaic_gpu.BlockSizes: stages ≥ 2 and compute_wgs 1 or 2, got {self.stages}, "
                             f"{self.compute_wgs}")

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of every tile a launch covers."""
        return math.lcm(self.compute_wgs * self.block_q, self.block_k, self.block_q_dkv,
                        self.compute_wgs * self.block_k_dkv)

    def clamp(self, length: int) -> BlockSizes:
        return self  # tiles cannot shrink below wgmma's 64 rows: short sequences are padded

    @classmethod
    def get_default(cls, head_dim: int, causal: bool = True) -> BlockSizes:
        """The device check's measured winner for this head dim and masking (`TUNED`), else the candidate at which
        no kernel spills (`candidates`' first)."""
        winner = tuned(head_dim, causal)
        return cls(**winner["blocks"]) if winner else next(iter(candidates(head_dim).values()))


def candidates(head_dim: int) -> dict[str, BlockSizes]:
    """The tile sets the device check times at a head dim, the spill-free one first (experiments/
    mosaic_gpu_resources.py; docs/kernels.md, "The Mosaic GPU kernel"). Up to d = 64 two compute warpgroups on their
    own rows with dQ formed in the dK/dV kernel (the arithmetic's work, no more) or in its own, or on shared rows split
    by map; above, where two maps' accumulators do not fit a thread together, the split by map with dQ in its own
    kernel or (the arithmetic's work, some spilled registers) in the dK/dV kernel, or one warpgroup by rows (V in two
    forward launches, dK and dV apart).
    `--smoke --compile-only` compiles each for an H100."""
    if head_dim <= 64:
        return {"rows, dq in dkv": BlockSizes(compute_wgs=2, dkv="fused"),
                "rows": BlockSizes(compute_wgs=2, dkv="pair"),
                "maps": BlockSizes(compute_wgs=2, forward="maps", dq="maps", dkv="pair"),
                "rows, dkv rows": BlockSizes(compute_wgs=2, dkv="rows")}
    return {"maps": BlockSizes(compute_wgs=1, forward="maps", dq="maps", dkv="pair"),
            "maps, dq in dkv": BlockSizes(compute_wgs=1, forward="maps", dq="maps", dkv="fused"),
            "rows": BlockSizes(compute_wgs=1, dkv="split")}


TUNED = Path(__file__).with_name("mosaic_gpu_tuned.json")  # written by experiments/device_check.py's attention section


def _head_class(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128  # the candidates' classes (head dims are padded to a multiple of 64)


@functools.cache
def _tuned_table() -> tuple[dict, ...]:
    return tuple(json.loads(TUNED.read_text())["entries"]) if TUNED.exists() else ()


def tuned(head_dim: int, causal: bool) -> dict | None:
    """The device check's entry for (head dim, causal): the fastest conforming candidate, its time against the
    cuDNN composition's, the device and versions; None where no device has timed them."""
    return next((e for e in _tuned_table() if e["head_dim"] == _head_class(head_dim) and e["causal"] == causal),
                None)


def measured_faster() -> bool:
    """Whether a device check measured the kernel faster than cuDNN's DIFF composition (`auto` then takes it)."""
    return any(e["vs_cudnn"] < 1 for e in _tuned_table())


# ------------------------------------------------------------------------------------------------------ the ops

_fused = fused_attention(forward, backward, lambda do, o: jnp.einsum("bhte,bhte->bht", do, o))


def _check_dtype(q):
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"impl 'mosaic_gpu' takes bfloat16 or float16 inputs (wgmma), got {q.dtype}: use 'pallas' "
                         f"or 'xla' for float32")


diff_attention, attention = public_ops(
    _fused, BlockSizes, lambda q, causal: BlockSizes.get_default(q.shape[-1], causal), heads_major=True,
    check_input=_check_dtype)

# "auto" takes it for DIFF once a device check measured it faster than cuDNN's composition
IMPL = Impl(attention, diff_attention, ("gpu",), ("bfloat16", "float16"),
            condition=lambda call: None if available() else "needs jax >= 0.11's Mosaic GPU",
            auto=lambda call: call.op == "diff_attention" and measured_faster())

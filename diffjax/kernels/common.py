"""What the fused Pallas kernels share (`pallas_gpu` on Triton, `pallas_tpu` on Mosaic TPU): constants, the
static per-call config, input checks and the padding done before the kernels run (docs/design.md §4).

Block sizes are not shared: each platform has its own config with its own tiling constraints
(`pallas_gpu.BlockSizes`, `pallas_tpu.BlockSizes`). `prepare` takes either, through `BlockConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG_INF = -1e30  # finite: a fully masked (padded) row stays finite instead of NaN
LOG2E = math.log2(math.e)  # logits use exp2 with 1/√d·log2(e) folded into one multiply


class BlockConfig(Protocol):
    """A platform's block sizes: frozen (hashable) and with the fields block_q, block_k, block_q_dkv,
    block_k_dkv, block_q_dq, block_k_dq."""

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this: every block divides it."""
        ...

    def clamp(self, length: int) -> BlockConfig:
        """Blocks for a sequence of `length` (no bigger than it needs, within the platform's tiling)."""
        ...


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static configuration of one call (hashable: it is a nondiff argument of the custom_vjp)."""

    causal: bool
    scale: float  # 1/√d of the *unpadded* head dim
    kv_len: int  # true key length; keys at ≥ kv_len are padding
    has_seg: bool
    blocks: BlockConfig
    interpret: bool
    residual_dtype: str | None = None  # O1, O2 saved for the backward in this dtype (None: the inputs')


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def check_shapes(q1, q2, k1, k2, v, segment_ids, kv_segment_ids=None):
    b, t, h, d = q1.shape
    s, n_kv = k1.shape[1], k1.shape[2]
    if q2.shape != q1.shape or k2.shape != k1.shape or k1.shape != (b, s, n_kv, d):
        raise ValueError(f"q1/q2 must be [B,T,H,d] and k1/k2 [B,S,K,d]: got {q1.shape=} {q2.shape=} "
                         f"{k1.shape=} {k2.shape=}")
    if v.shape[:3] != (b, s, n_kv):
        raise ValueError(f"v must be [B,S,K,e] matching k1 {k1.shape}: got {v.shape}")
    if h % n_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({n_kv})")
    if kv_segment_ids is not None:  # a block of a split sequence: queries and keys from different places
        if segment_ids is None or segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, s):
            raise ValueError(f"segment_ids must be [B, T] = {(b, t)} and kv_segment_ids [B, S] = {(b, s)}, got "
                             f"{None if segment_ids is None else segment_ids.shape} and {kv_segment_ids.shape}")
    elif segment_ids is not None and (segment_ids.shape != (b, t) or t != s):
        raise ValueError(f"segment_ids must be [B, T] = {(b, t)} with T == S, got {segment_ids.shape}, S={s}")


def prepare(q1, q2, k1, k2, v, segment_ids, *, causal: bool, blocks: BlockConfig, interpret: bool,
            kv_segment_ids=None, residual_dtype: str | None = None):
    """Pad sequence and head dims; returns the padded [B, T, H, d] arrays, the segment ids as a (query [B, T],
    key [B, S]) pair or None (`kv_segment_ids` None: the queries' own), and the static config.

    Sequences are padded to `blocks.multiple` after clamping to the longer of T and S (padded keys are
    masked in-kernel; padded query rows are sliced off by the caller, so they get dO = 0). Head dims are
    zero-padded to a power of two ≥ 16, which changes no dot product: Triton tiles must be powers of two;
    on TPU the head dim is a whole block dim, so any size tiles. Padded segment ids are -1.
    """
    b, t, h, d = q1.shape
    s = k1.shape[1]
    blocks = blocks.clamp(max(t, s))
    m = blocks.multiple
    tp, sp = round_up(t, m), round_up(s, m)
    dp, ep = max(16, pl.next_power_of_2(d)), max(16, pl.next_power_of_2(v.shape[-1]))
    q1, q2 = (pad_axis(pad_axis(x, 1, tp), 3, dp) for x in (q1, q2))
    k1, k2 = (pad_axis(pad_axis(x, 1, sp), 3, dp) for x in (k1, k2))
    v = pad_axis(pad_axis(v, 1, sp), 3, ep)
    seg = None
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        seg = (pad_axis(segment_ids.astype(jnp.int32), 1, tp, value=-1),
               pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp, value=-1))
    cfg = KernelConfig(causal=causal, scale=1.0 / math.sqrt(d), kv_len=s, has_seg=seg is not None, blocks=blocks,
                       interpret=interpret, residual_dtype=residual_dtype)
    return q1, q2, k1, k2, v, seg, cfg



# Matmul FLOPs per visible (query, key) pair of one head, as multiples of (d, e), both maps counted:
# forward: S1, S2 (2·2d) and P1·V, P2·V (2·2e); dQ kernel: S1, S2 recomputed, dP = dO·Vᵀ, dQ1, dQ2 (8d + 2e);
# dK/dV kernel: S1, S2, dP, dK1, dK2, dV (8d + 4e).
_FLOPS_PER_PAIR = {"forward": (4, 4), "dq": (8, 2), "dkv": (8, 4)}


def cost_estimate(kernel: str, dims: tuple[int, ...], operands, outputs, *, causal: bool) -> pl.CostEstimate:
    """What one `pallas_call` costs, so XLA's scheduler and `cost_analysis` see the fused kernel (a custom call
    is otherwise counted as free). dims = (B, query heads, T, S, d, e) of the padded arrays; causal masking
    halves the visible pairs; bytes are every operand and output read or written once."""
    b, h, t, s, d, e = dims
    pairs = b * h * t * s * (0.5 if causal else 1.0)
    per_d, per_e = _FLOPS_PER_PAIR[kernel]
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*operands, *outputs))
    return pl.CostEstimate(flops=int(2 * pairs * (per_d * d + per_e * e)), transcendentals=int(2 * pairs),
                           bytes_accessed=int(nbytes))

"""What the fused Pallas kernels (`pallas_gpu` on Triton, `pallas_tpu` on Mosaic TPU) share: constants, the static
per-call config, input checks, padding and kernel helpers (docs/design.md §4). Block sizes are per platform."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from diffjax.kernels.reference import differential

NEG_INF = -1e30  # finite: a fully masked (padded) row stays finite instead of NaN
LOG2E = math.log2(math.e)  # logits use exp2 with 1/√d·log2(e) folded into one multiply


class BlockConfig(Protocol):
    """A platform's frozen block sizes: block_q, block_k, block_q_dkv, block_k_dkv, block_q_dq, block_k_dq."""

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


def check_shapes(queries, keys, v, segment_ids, kv_segment_ids=None):
    """queries [q] or [q1, q2] [B, T, H, d]; keys likewise [B, S, K, d]; v [B, S, K, e]."""
    b, t, h, d = queries[0].shape
    s, n_kv = keys[0].shape[1], keys[0].shape[2]
    if (len(queries) != len(keys) or any(q.shape != (b, t, h, d) for q in queries)
            or any(k.shape != (b, s, n_kv, d) for k in keys)):
        raise ValueError(f"each query must be [B,T,H,d] and each key [B,S,K,d], as many of each: got queries "
                         f"{[q.shape for q in queries]}, keys {[k.shape for k in keys]}")
    if v.shape[:3] != (b, s, n_kv):
        raise ValueError(f"v must be [B,S,K,e] matching the keys {keys[0].shape}: got {v.shape}")
    if h % n_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({n_kv})")
    if kv_segment_ids is not None:  # a block of a split sequence: queries and keys from different places
        if segment_ids is None or segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, s):
            raise ValueError(f"segment_ids must be [B, T] = {(b, t)} and kv_segment_ids [B, S] = {(b, s)}, got "
                             f"{None if segment_ids is None else segment_ids.shape} and {kv_segment_ids.shape}")
    elif segment_ids is not None and (segment_ids.shape != (b, t) or t != s):
        raise ValueError(f"segment_ids must be [B, T] = {(b, t)} with T == S, got {segment_ids.shape}, S={s}")


def prepare(queries, keys, v, segment_ids, *, causal: bool, blocks: BlockConfig, interpret: bool,
            kv_segment_ids=None, residual_dtype: str | None = None):
    """Padded [B, T, H, d] queries, keys (lists) and v, the segment ids as a (query [B, T], key [B, S]) pair or None
    (`kv_segment_ids` None: the queries' own) and the static config. Sequences are padded to a multiple of the blocks
    (padded keys masked in-kernel, padded segment ids -1), head dims with zeros to a power of two ≥ 16 (≥ the blocks'
    `head_multiple`, where they have one; v's ≥ their `value_multiple(maps)`)."""
    b, t, h, d = queries[0].shape
    s = keys[0].shape[1]
    blocks = blocks.clamp(max(t, s))
    m = blocks.multiple
    tp, sp = round_up(t, m), round_up(s, m)
    least = getattr(blocks, "head_multiple", 16)
    least_v = blocks.value_multiple(len(queries)) if hasattr(blocks, "value_multiple") else least
    dp, ep = max(least, pl.next_power_of_2(d)), max(least_v, pl.next_power_of_2(v.shape[-1]))
    queries = [pad_axis(pad_axis(x, 1, tp), 3, dp) for x in queries]
    keys = [pad_axis(pad_axis(x, 1, sp), 3, dp) for x in keys]
    v = pad_axis(pad_axis(v, 1, sp), 3, ep)
    seg = None
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        seg = (pad_axis(segment_ids.astype(jnp.int32), 1, tp, value=-1),
               pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp, value=-1))
    cfg = KernelConfig(causal=causal, scale=1.0 / math.sqrt(d), kv_len=s, has_seg=seg is not None, blocks=blocks,
                       interpret=interpret, residual_dtype=residual_dtype)
    return queries, keys, v, seg, cfg


def public_ops(fused, block_type: type, default_blocks, *, heads_major: bool, check_input=lambda q: None):
    """A fused kernel's public `diff_attention` and `attention` (shapes as `diffjax.kernels.diff_attention`, [B, T, H,
    d]): inputs checked, padded, in the kernels' layout ([B, H, T, d] when `heads_major`, as Mosaic's tiling wants)
    and back, padding sliced off. `fused` is the platform's op (`fused_vjp.fused_attention`); `block_sizes` must be
    its `block_type`, None taking `default_blocks(q, causal)`; `check_input(q)` refuses what its kernels cannot take."""
    platform = f"{block_type.__module__.rsplit('.', 1)[-1]}.{block_type.__name__}"

    @functools.partial(jax.jit, static_argnames=("causal", "interpret", "blocks"))
    def run(queries, keys, v, lam, *, causal, segment_ids, interpret, blocks):
        check_shapes(queries, keys, v, segment_ids)
        t, e = queries[0].shape[1], v.shape[-1]
        queries, keys, v, seg, cfg = prepare(queries, keys, v, segment_ids, causal=causal, blocks=blocks,
                                             interpret=interpret)
        layout = (lambda x: jnp.swapaxes(x, 1, 2)) if heads_major else (lambda x: x)  # its own inverse
        out = fused([layout(q) for q in queries], [layout(k) for k in keys], layout(v), lam, seg, cfg)
        return layout(out)[:, :t, :, :e]

    def call(queries, keys, v, lam, causal, segment_ids, interpret, block_sizes):
        if block_sizes is not None and not isinstance(block_sizes, block_type):
            raise TypeError(f"block_sizes must be {platform}, got {type(block_sizes).__module__}."
                            f"{type(block_sizes).__name__}")
        check_input(queries[0])
        return run(queries, keys, v, lam, causal=causal, segment_ids=segment_ids, interpret=interpret,
                   blocks=block_sizes or default_blocks(queries[0], causal))

    def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False, block_sizes=None):
        """Fused differential attention, shapes as `diffjax.kernels.diff_attention`; `block_sizes` None: the
        platform's default for this head dim (`BlockSizes.get_default`)."""
        return call([q1, q2], [k1, k2], v, jnp.asarray(lam, jnp.float32), causal, segment_ids, interpret, block_sizes)

    def attention(q, k, v, *, causal=True, segment_ids=None, interpret=False, block_sizes=None):
        """The standard op through the same kernels with one softmax map (no λ), at DIFF's default blocks."""
        return call([q], [k], v, None, causal, segment_ids, interpret, block_sizes)

    return diff_attention, attention


def shape_of(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def forward_outputs(o_shape, lse_shape, o_spec, lse_spec, dtype, cfg: KernelConfig, maps: int, residuals: bool):
    """The forward's out_shape and out_specs: o, then with `residuals` each map's O_i and its log-sum-exp."""
    n = maps if residuals else 0
    shapes = [jax.ShapeDtypeStruct(o_shape, dtype)] + [jax.ShapeDtypeStruct(o_shape, cfg.residual_dtype or dtype)] * n
    return shapes + [jax.ShapeDtypeStruct(lse_shape, jnp.float32)] * n, [o_spec] * (1 + n) + [lse_spec] * n


def and_(mask, new):
    """`new` and-ed into the boolean `mask`, or `new` where there is no mask yet (None)."""
    return new if mask is None else jnp.logical_and(mask, new)


def kernel_name(maps: int, kind: str, suffix: str = "") -> str:
    """The `pallas_call` name of kernel `kind` ("forward", "dq", "dkv"), as compiler dumps show it ("diff_flash_fwd",
    "flash_bwd_dq"; tools find the PTX by it)."""
    return f"{'diff_' if maps == 2 else ''}flash_{'fwd' if kind == 'forward' else 'bwd_' + kind}{suffix}"


def combine(outs, lam):
    """The op's output from its maps' (or probabilities'): O1 for the standard op (`lam` None), O1 − λ·O2 for DIFF.
    The kernels build dV's weights P1 − λ·P2 with it too."""
    return outs[0] if lam is None else differential(outs[0], outs[1], lam)


def lambda_grad(d2, lam):
    """dλ = −Σ dO∘O2 = −Σ D2, D2 = rowsum(dO∘O2) in any layout: ∂/∂λ of Σ dO∘(O1 − λ·O2), the output `combine`
    builds; in λ's dtype. None for the standard op (`lam` None)."""
    return None if lam is None else (-jnp.sum(d2)).astype(jnp.result_type(lam))


def weighted(i: int, x, lam):
    """c_i·x for map i of DIFF's output O1 − λ·O2: c = (1, −λ)."""
    return -lam * x if i == 1 else x


def score_grad(i: int, p, dp, rowsum, lam):
    """dS_i = c_i·P_i∘(dP − D_i) of map i (`rowsum` D_i already broadcast against dP)."""
    return weighted(i, p * (dp - rowsum), lam)


def score_grads(ps, dp, rowsums, lam):
    """`score_grad` of every map."""
    return [score_grad(i, p, dp, d, lam) for i, (p, d) in enumerate(zip(ps, rowsums, strict=True))]


def kernel_refs(refs, maps: int, has_seg: bool, backward: bool = False):
    """A kernel's refs in the order both platforms pass them: (queries, keys, v, [backward: dO, lses, rowsums,] λ or
    None, query segment ids, key segment ids, the rest: outputs and scratch)."""
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    queries, keys, (v_ref,) = take(maps), take(maps), take(1)
    stats = (refs.pop(0), take(maps), take(maps)) if backward else ()
    lam_ref = refs.pop(0) if maps == 2 else None
    q_seg_ref, k_seg_ref = take(2) if has_seg else (None, None)
    return queries, keys, v_ref, *stats, lam_ref, q_seg_ref, k_seg_ref, refs


# Matmul FLOPs per visible (query, key) pair of one head, as multiples of (d, e): per map, forward S and P·V,
# backward S recomputed and dQ or dK; once for all maps, dP = dO·Vᵀ (dQ kernel) and dP, dV (dK/dV kernel).
_FLOPS_PER_MAP = {"forward": (2, 2), "dq": (4, 0), "dkv": (4, 0)}
_FLOPS_SHARED = {"forward": (0, 0), "dq": (0, 2), "dkv": (0, 4)}


def cost_estimate(kernel: str, dims: tuple[int, ...], operands, outputs, *, causal: bool,
                  maps: int = 2) -> pl.CostEstimate:
    """What one `pallas_call` costs, so XLA's scheduler and `cost_analysis` see it (a custom call is otherwise free).
    dims = (B, query heads, T, S, d, e) of the padded arrays; causal halves the pairs; bytes: every array once."""
    b, h, t, s, d, e = dims
    pairs = b * h * t * s * (0.5 if causal else 1.0)
    per_d, per_e = (maps * m + shared for m, shared in zip(_FLOPS_PER_MAP[kernel], _FLOPS_SHARED[kernel],
                                                            strict=True))
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*operands, *outputs))
    return pl.CostEstimate(flops=int(2 * pairs * (per_d * d + per_e * e)), transcendentals=int(maps * pairs),
                           bytes_accessed=int(nbytes))

"""Fused differential flash attention for GPU: Pallas with the Triton lowering (docs/design.md §4).

    out = (softmax(s·q1 k1ᵀ) − λ·softmax(s·q2 k2ᵀ)) v,   s = 1/√d

A forward kernel with two online softmaxes over one V tile, a dQ and a dK/dV backward kernel (no atomics); the
standard op is the same kernels with one map. Derivation, tiles, registers and the Triton deprecation:
docs/kernels.md. With `interpret=True` the kernels run on CPU (how the tests check them).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from diffjax.kernels.common import (
    LOG2E,
    NEG_INF,
    KernelConfig,
    and_,
    combine,
    cost_estimate,
    forward_outputs,
    kernel_name,
    kernel_refs,
    public_ops,
    score_grads,
    shape_of,
)
from diffjax.kernels.fused_blocks import FusedBlocks
from diffjax.kernels.fused_vjp import fused_attention
from diffjax.kernels.impl import Impl

try:  # deprecated in JAX 0.12; once removed, "auto" gives DIFF on a GPU to cuDNN's composition
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

_BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


def _is_pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


# Default tiles per (GPU generation, head dim padded to 64 or 128): forward q × k, dK/dV q × k, dQ q × k, at 8 warps
# and 2 stages: the largest that spill no registers within shared memory (docs/kernels.md, "Registers and spills").
_DEFAULT_TILES = {
    ("sm_90", 64): (128, 32, 32, 128, 128, 64),
    ("sm_90", 128): (64, 32, 16, 64, 128, 32),
    ("sm_80", 64): (64, 64, 64, 32, 128, 32),
    ("sm_80", 128): (32, 64, 64, 32, 64, 32),
}
# float32 inputs: IEEE fp32 dots on CUDA cores hold their operands in registers and twice the shared memory.
_FLOAT32_TILES = (32, 16, 16, 32, 32, 16)


def _generation(arch: str | None) -> str:
    """"sm_80" below compute capability 9 ("8.0", "8.6", "sm_80"), else "sm_90"."""
    if arch is None:
        return "sm_90"
    major = int(re.match(r"sm_(\d+)", arch)[1]) // 10 if arch.startswith("sm_") else int(arch.split(".")[0])
    return "sm_80" if major < 9 else "sm_90"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """GPU tile sizes (forward block_q × block_k, dK/dV *_dkv, dQ *_dq): powers of two ≥ 16, the smallest `tl.dot`
    tile. The field defaults are Hopper's at d = 128; `get_default` picks per head dim, dtype and GPU generation."""

    block_q: int = 64
    block_k: int = 32
    block_q_dkv: int = 16
    block_k_dkv: int = 64
    block_q_dq: int = 128
    block_k_dq: int = 32
    num_warps: int | None = None  # None: 8 (at 4, the default tiles spill)
    num_stages: int = 2

    def __post_init__(self):
        for f in _BLOCK_FIELDS:
            value = getattr(self, f)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"BlockSizes.{f} must be a power of two ≥ 16 (Triton tile), got {value!r}")
        if self.num_warps is not None and not _is_pow2(self.num_warps):
            raise ValueError(f"BlockSizes.num_warps must be a power of two or None, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages must be an int ≥ 1, got {self.num_stages!r}")

    @classmethod
    def get_default(cls, head_dim: int = 128, dtype=None, arch: str | None = None) -> BlockSizes:
        """Defaults for q/k head dim `head_dim`, input `dtype` and compute capability `arch` ("9.0", "8.0" as
        `device.compute_capability`, or "sm_90a", "sm_80"; None: Hopper, as JAX's Triton lowering assumes without a
        GPU): sm_80's tiles before Hopper, Hopper's from it on; d ≤ 64 or the d = 128 tiles; float32 its own."""
        float32 = dtype is not None and jnp.dtype(dtype).itemsize >= 4
        tiles = _FLOAT32_TILES if float32 else _DEFAULT_TILES[_generation(arch), 64 if head_dim <= 64 else 128]
        return cls(*tiles, num_warps=8, num_stages=2)

    @property
    def multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this (all blocks are powers of two, so the max)."""
        return max(getattr(self, f) for f in _BLOCK_FIELDS)

    def clamp(self, length: int) -> BlockSizes:
        """Shrink blocks for short sequences (never below 16, the smallest Triton dot tile)."""
        cap = max(16, pl.next_power_of_2(length))
        return dataclasses.replace(self, **{f: min(getattr(self, f), cap) for f in _BLOCK_FIELDS})


def _dot(a, b):
    # HIGHEST: IEEE fp32 on GPU for float32 inputs (default would be TF32); no effect for bf16.
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)


def _dot_t(a, b):
    return _dot(a, b.T)


def _mask(q_pos, k_pos, q_seg, k_seg, cfg: KernelConfig, kv_padded: bool, transposed: bool = False):
    """Boolean [bq, bk] mask ([bk, bq] when `transposed`), or None when nothing needs masking."""
    q_ax, k_ax = ((slice(None), None), (None, slice(None))) if not transposed else ((None, slice(None)),
                                                                                      (slice(None), None))
    mask = q_pos[q_ax] >= k_pos[k_ax] if cfg.causal else None
    if kv_padded:
        mask = and_(mask, (k_pos < cfg.kv_len)[k_ax])
    if q_seg is not None:
        mask = and_(mask, q_seg[q_ax] == k_seg[k_ax])
    return mask


def _logits(q, k, mask, c):
    s = _dot_t(q, k) * c
    return s if mask is None else jnp.where(mask, s, NEG_INF)


def _online_step(s, v, acc, m, l):  # noqa: E741
    """One flash step for logits tile s (base 2): rescale the running state, add p·v."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l_new = alpha * l + jnp.sum(p, axis=-1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l_new


def _visible_k_blocks(i, bq, bk, n_k, causal):
    """How many key blocks query block i visits: causal, none after the last it sees."""
    return jnp.minimum(lax.div((i + 1) * bq + bk - 1, bk), n_k) if causal else n_k


def _fwd_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool, residuals: bool):
    q_refs, k_refs, v_ref, lam_ref, q_seg_ref, k_seg_ref, (o_ref, *res_refs) = kernel_refs(refs, maps, cfg.has_seg)
    bq, bk = q_refs[0].shape[0], cfg.blocks.block_k
    c = cfg.scale * LOG2E
    i = pl.program_id(0)

    queries = [q_ref[...] for q_ref in q_refs]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = q_seg_ref[pl.ds(i * bq, bq)] if q_seg_ref is not None else None

    def body(j, carry):  # carry: (acc, m, l) per map
        ks = pl.ds(j * bk, bk)
        k_seg = k_seg_ref[ks] if k_seg_ref is not None else None
        mask = _mask(q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg, kv_padded)
        v = v_ref[ks, :]  # one V tile, every map
        return tuple(_online_step(_logits(q, k_ref[ks, :], mask, c), v, *state)
                     for q, k_ref, state in zip(queries, k_refs, carry, strict=True))

    e = v_ref.shape[-1]
    state0 = (jnp.zeros((bq, e), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
    hi = _visible_k_blocks(i, bq, bk, k_refs[0].shape[0] // bk, cfg.causal)
    states = lax.fori_loop(0, hi, body, (state0,) * maps)

    outs = [acc / l[:, None] for acc, _, l in states]  # noqa: E741
    o_ref[...] = combine(outs, None if lam_ref is None else lam_ref[0]).astype(o_ref.dtype)  # float32, one cast
    if residuals:
        for o, o_i_ref in zip(outs, res_refs[:maps], strict=True):
            o_i_ref[...] = o.astype(o_i_ref.dtype)
        for (_, m, l), lse_ref in zip(states, res_refs[maps:], strict=True):  # noqa: E741
            lse_ref[...] = m + jnp.log2(l)


def triton_available() -> bool:
    """Whether this JAX still lowers Pallas to Triton: the backend is there and its deprecation has not been made an
    error (JAX "accelerates" a deprecation before removing the feature: then the lowering raises)."""
    if plgpu is None:
        return False
    try:
        from jax._src import deprecations
        return not deprecations.is_accelerated("jax-pallas-triton")
    except (ImportError, AttributeError, ValueError):  # a JAX before the deprecation (0.10, 0.11): none registered
        return True


def _pallas_call(kernel, kind: str, dims, args, *, cfg: KernelConfig, maps: int, **kw):
    """Kernel `kind` ("forward", "dq", "dkv") on `args`, with its cost and name, the blocks' warps and stages."""
    if plgpu is None:
        raise RuntimeError(f"jax {jax.__version__} has no Pallas Triton backend: use impl='cudnn' or 'xla'")
    params = plgpu.CompilerParams(num_warps=cfg.blocks.num_warps or 8, num_stages=cfg.blocks.num_stages)
    cost = cost_estimate(kind, dims, args, kw["out_shape"], causal=cfg.causal, maps=maps)
    return pl.pallas_call(kernel, compiler_params=params, interpret=cfg.interpret, cost_estimate=cost,
                          name=kernel_name(maps, kind), **kw)(*args)


def _specs(bq, s, d, e, g):
    """BlockSpecs on a grid (query block, batch, head): [bq, d] and [bq, e] row tiles, the whole K and V of the
    head's kv head, [bq] row statistics."""
    rows, kv = (lambda i, bi, hi: (bi, i, hi, 0)), (lambda i, bi, hi: (bi, 0, hi // g, 0))
    return (pl.BlockSpec((None, bq, None, d), rows), pl.BlockSpec((None, bq, None, e), rows),
            pl.BlockSpec((None, s, None, d), kv), pl.BlockSpec((None, s, None, e), kv),
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)))


def _extra_specs(lam, cfg: KernelConfig, t, s):
    """λ's BlockSpec (DIFF), then whole rows of query and key segment ids (with segment ids)."""
    return ([] if lam is None else [pl.BlockSpec((1,), lambda *_: (0,))]) + (
        [pl.BlockSpec((None, n), lambda i, bi, hi: (bi, 0)) for n in (t, s)] if cfg.has_seg else [])


def _forward(queries, keys, v, lam, seg, cfg: KernelConfig, residuals: bool):
    """One softmax map (queries [q], keys [k], lam None) or two (DIFF) -> (o, [O_i], [lse_i]) ([O_i], [lse_i] empty
    without `residuals`)."""
    maps = len(queries)
    b, t, h, d = queries[0].shape
    s, n_kv, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    bq = cfg.blocks.block_q
    q_spec, o_spec, k_spec, v_spec, lse_spec = _specs(bq, s, d, e, h // n_kv)
    args = [*queries, *keys, v] + ([] if lam is None else [lam.reshape(1)]) + (list(seg) if cfg.has_seg else [])
    out_shape, out_specs = forward_outputs((b, t, h, e), (b, h, t), o_spec, lse_spec, queries[0].dtype, cfg, maps,
                                           residuals)
    o, *res = _pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, maps=maps, kv_padded=s != cfg.kv_len, residuals=residuals),
        "forward", (b, h, t, s, d, e), args, cfg=cfg, maps=maps, grid=(t // bq, b, h), out_specs=out_specs,
        in_specs=[q_spec] * maps + [k_spec] * maps + [v_spec] + _extra_specs(lam, cfg, t, s), out_shape=out_shape)
    return o, res[:len(res) // 2], res[len(res) // 2:]


def _dq_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, dq_refs = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    bq, bk = q_refs[0].shape[0], cfg.blocks.block_k_dq
    c = cfg.scale * LOG2E
    i = pl.program_id(0)
    lam = None if lam_ref is None else lam_ref[0]

    queries, do = [r[...] for r in q_refs], do_ref[...]
    lses, rowsums = [r[...] for r in lse_refs], [r[...][:, None] for r in d_refs]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = q_seg_ref[pl.ds(i * bq, bq)] if q_seg_ref is not None else None

    def body(j, dqs):
        ks = pl.ds(j * bk, bk)
        keys = [r[ks, :] for r in k_refs]
        k_seg = k_seg_ref[ks] if k_seg_ref is not None else None
        mask = _mask(q_pos, j * bk + jnp.arange(bk), q_seg, k_seg, cfg, kv_padded)
        # P_i recomputed from the saved log-sum-exps; dP = dO·Vᵀ once for every map
        ps = [jnp.exp2(_logits(q, k, mask, c) - lse[:, None]) for q, k, lse in zip(queries, keys, lses, strict=True)]
        ds = score_grads(ps, _dot_t(do, v_ref[ks, :]), rowsums, lam)
        return tuple(dq + _dot(dsi.astype(k.dtype), k) for dq, dsi, k in zip(dqs, ds, keys, strict=True))

    zero = jnp.zeros(queries[0].shape, jnp.float32)
    hi = _visible_k_blocks(i, bq, bk, k_refs[0].shape[0] // bk, cfg.causal)
    dqs = lax.fori_loop(0, hi, body, (zero,) * maps)
    for dq, dq_ref in zip(dqs, dq_refs, strict=True):
        dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, maps: int, kv_padded: bool):
    q_refs, k_refs, v_ref, do_ref, lse_refs, d_refs, lam_ref, q_seg_ref, k_seg_ref, out_refs = kernel_refs(
        refs, maps, cfg.has_seg, backward=True)
    dk_refs, dv_ref = out_refs[:maps], out_refs[maps]
    bk, bq = k_refs[0].shape[0], cfg.blocks.block_q_dkv
    n_q, group = q_refs[0].shape[0] // bq, q_refs[0].shape[1]
    c = cfg.scale * LOG2E
    j = pl.program_id(0)
    lam = None if lam_ref is None else lam_ref[0]

    keys, v = [r[...] for r in k_refs], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    k_seg = k_seg_ref[pl.ds(j * bk, bk)] if k_seg_ref is not None else None
    lo = lax.div(j * bk, bq) if cfg.causal else 0  # query blocks that end before this key block see none of it

    # Tiles are transposed, [bk, bq] (Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ), so dV += Pᵀ·dO and dK += dSᵀ·Q take a register tile
    # as their left operand as it is: transposing [bq, bk] tiles made this kernel spill (docs/kernels.md).
    def q_body(qi, carry, g):
        dks, dv = carry
        qs = pl.ds(qi * bq, bq)
        queries, do = [r[qs, g, :] for r in q_refs], do_ref[qs, g, :]
        q_seg = q_seg_ref[qs] if q_seg_ref is not None else None
        mask = _mask(qi * bq + jnp.arange(bq), k_pos, q_seg, k_seg, cfg, kv_padded, transposed=True)
        pts = [jnp.exp2(_logits(k, q, mask, c) - lse_ref[g, qs][None, :])
               for k, q, lse_ref in zip(keys, queries, lse_refs, strict=True)]
        dpt = _dot_t(v, do)
        dv = dv + _dot(combine(pts, lam).astype(do.dtype), do)
        dst = score_grads(pts, dpt, [d_ref[g, qs][None, :] for d_ref in d_refs], lam)
        return tuple(dk + _dot(ds.astype(q.dtype), q) for dk, ds, q in zip(dks, dst, queries, strict=True)), dv

    def g_body(g, carry):  # the query heads sharing this kv head: GQA sum without atomics
        return lax.fori_loop(lo, n_q, functools.partial(q_body, g=g), carry)

    zk = jnp.zeros(keys[0].shape, jnp.float32)
    dks, dv = lax.fori_loop(0, group, g_body, ((zk,) * maps, jnp.zeros(v.shape, jnp.float32)))
    for dk, dk_ref in zip(dks, dk_refs, strict=True):
        dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_kernels(queries, keys, v, lam, seg, do, lses, rowsums, cfg: KernelConfig):
    """-> ([dq_i], [dk_i], dv) for one map or two (as `_forward`)."""
    maps = len(queries)
    b, t, h, d = queries[0].shape
    s, n_kv, e = keys[0].shape[1], keys[0].shape[2], v.shape[-1]
    g = h // n_kv
    args = (*queries, *keys, v, do, *lses, *rowsums, *([] if lam is None else [lam.reshape(1)]),
            *(seg if cfg.has_seg else []))
    dims = (b, h, t, s, d, e)
    kernel_args = dict(cfg=cfg, maps=maps, kv_padded=s != cfg.kv_len)

    # dQ: grid (query block, batch, head); whole K/V of the head's kv head.
    bq = cfg.blocks.block_q_dq
    q_spec, do_spec, k_spec, v_spec, row_spec = _specs(bq, s, d, e, g)
    d_queries = _pallas_call(
        functools.partial(_dq_kernel, **kernel_args), "dq", dims, args, cfg=cfg, maps=maps, grid=(t // bq, b, h),
        in_specs=[*[q_spec] * maps, *[k_spec] * maps, v_spec, do_spec, *[row_spec] * (2 * maps),
                  *_extra_specs(lam, cfg, t, s)],
        out_specs=[q_spec] * maps, out_shape=[shape_of(queries[0])] * maps)

    # dK/dV: grid (key block, batch, kv head); all T rows of the group's g query heads.
    bk = cfg.blocks.block_k_dkv
    qg_spec, dog_spec = (pl.BlockSpec((None, t, g, n), lambda j, bi, ki: (bi, 0, ki, 0)) for n in (d, e))
    kb_spec, vb_spec = (pl.BlockSpec((None, bk, None, n), lambda j, bi, ki: (bi, j, ki, 0)) for n in (d, e))
    rowg_spec = pl.BlockSpec((None, g, t), lambda j, bi, ki: (bi, ki, 0))
    *d_keys, dv = _pallas_call(
        functools.partial(_dkv_kernel, **kernel_args), "dkv", dims, args, cfg=cfg, maps=maps, grid=(s // bk, b, n_kv),
        in_specs=[*[qg_spec] * maps, *[kb_spec] * maps, vb_spec, dog_spec, *[rowg_spec] * (2 * maps),
                  *_extra_specs(lam, cfg, t, s)],
        out_specs=[*[kb_spec] * maps, vb_spec], out_shape=[shape_of(keys[0])] * maps + [shape_of(v)])
    return list(d_queries), d_keys, dv


# D_i as [B, H, T], like the lse
_fused = fused_attention(_forward, _backward_kernels, lambda do, o: jnp.einsum("bthe,bthe->bht", do, o))


def target_arch() -> str | None:
    """The compute capability ("9.0", "8.0") of the GPU the kernels are compiled for: the context mesh's devices
    (`jax.set_mesh`, as a deviceless compile for a GPU target runs), else this host's GPU; None if neither is one."""
    try:
        from jax._src import mesh as mesh_lib  # JAX has no public accessor for the concrete mesh inside a trace

        mesh = mesh_lib.get_concrete_mesh()
        devices = [] if mesh is None or mesh.empty else list(mesh.devices.flat)
    except (ImportError, AttributeError):
        devices = []
    if not devices and jax.default_backend() == "gpu":
        devices = jax.devices()
    if devices and devices[0].platform == "gpu" and getattr(devices[0], "compute_capability", None):
        return str(devices[0].compute_capability)
    return None


def _default_blocks(q, causal: bool = True) -> BlockSizes:
    """For this head dim, dtype and target GPU (`target_arch`)."""
    return BlockSizes.get_default(q.shape[-1], q.dtype, target_arch())


diff_attention, attention = public_ops(_fused, BlockSizes, _default_blocks, heads_major=False)


def block_kernels(interpret: bool = False) -> FusedBlocks:
    """These kernels on one block of a split sequence (context parallelism), at the default block sizes."""
    return FusedBlocks(_forward, _backward_kernels, _default_blocks, heads_major=False, interpret=interpret)


IMPL = Impl(attention, diff_attention, ("gpu",), blocks=block_kernels,
            condition=lambda call: None if triton_available() else "needs Pallas' Triton lowering, gone from this JAX")

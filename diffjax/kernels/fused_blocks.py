"""The fused kernels on one block of a split sequence: what context parallelism calls per (query, key) block
(`context_parallel.py`; docs/design.md §3), for DIFF (two maps) and the standard op (one).

    outs, lses = blocks.forward(queries, keys, v, causal=..., q_segment_ids=..., kv_segment_ids=...)
    d_queries, d_keys, d_v = blocks.backward(queries, keys, v, lam, d_out, lses, rowsums, causal=..., ...)

queries = [q1, q2] [B, Tq, H, d], keys = [k1, k2] [B, Tk, K, d], v [B, Tk, K, e] for DIFF; [q], [k] and lam None for
the standard op. `causal`: the diagonal block (Tq == Tk, top-left aligned), else every key is visible but for segment
ids (separate for queries and keys).

forward: per map, the block's own normalised output O_i (float32: the merge across blocks subtracts the maps only
at the end, and rounding them to bf16 first would be amplified by that cancellation) and log-sum-exp (natural log,
[B, H, Tq]) — the kernel's residual outputs. backward: this block's share of the gradients given the *global*
log-sum-exps and D_i = rowsum(dO ∘ O_i) of the merged outputs (flash attention's backward needs nothing else, so
the kernels' own backward serves unchanged: P = exp(s − lse) is then the block's slice of the global map).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from diffjax.kernels.common import LOG2E, check_shapes, pad_axis, prepare


@dataclasses.dataclass(frozen=True)
class FusedBlocks:
    """A platform's fused kernels (`pallas_gpu`, `pallas_tpu`) as block functions.

    kernel_forward / kernel_backward: the module's `_forward` and `_backward_kernels` (padded arrays in its layout);
    default_blocks(q1): its block sizes for these inputs; heads_major: the kernels take [B, H, T, d] (TPU) rather
    than [B, T, H, d], with row statistics as [B, H, T, 1] columns rather than [B, H, T].
    """

    kernel_forward: Callable
    kernel_backward: Callable
    default_blocks: Callable
    heads_major: bool
    interpret: bool = False

    def _prepare(self, queries, keys, v, causal, q_segment_ids, kv_segment_ids):
        check_shapes(queries, keys, v, q_segment_ids, kv_segment_ids if q_segment_ids is not None else None)
        queries, keys, v, seg, cfg = prepare(queries, keys, v, q_segment_ids, causal=causal, interpret=self.interpret,
                                             blocks=self.default_blocks(queries[0]), kv_segment_ids=kv_segment_ids,
                                             residual_dtype="float32")
        return [self._layout(x) for x in queries], [self._layout(x) for x in keys], self._layout(v), seg, cfg

    def _layout(self, x):  # [B, T, H, d] <-> the kernels' layout (its own inverse)
        return jnp.swapaxes(x, 1, 2) if self.heads_major else x

    def _rows_in(self, r, length: int):  # [B, H, T] float32 -> padded to `length`, in the kernels' layout
        r = pad_axis(r, 2, length)
        return r[..., None] if self.heads_major else r

    def _rows_out(self, r, length: int):
        return (r[..., 0] if self.heads_major else r)[..., :length]

    def forward(self, queries, keys, v, *, causal: bool, q_segment_ids=None, kv_segment_ids=None):
        t, e = queries[0].shape[1], v.shape[-1]
        queries, keys, v, seg, cfg = self._prepare(queries, keys, v, causal, q_segment_ids, kv_segment_ids)
        lam = None if len(queries) == 1 else jnp.zeros((), jnp.float32)  # the combined output is not used
        _, outs, lses = self.kernel_forward(queries, keys, v, lam, seg, cfg, residuals=True)
        return ([self._layout(o)[:, :t, :, :e] for o in outs],
                [self._rows_out(lse, t) / LOG2E for lse in lses])  # base 2 -> natural log

    def backward(self, queries, keys, v, lam, d_out, lses, rowsums, *, causal: bool, q_segment_ids=None,
                 kv_segment_ids=None):
        (t, d), (s, e) = queries[0].shape[1::2], v.shape[1::2]
        queries, keys, v, seg, cfg = self._prepare(queries, keys, v, causal, q_segment_ids, kv_segment_ids)
        tp, ep = queries[0].shape[2 if self.heads_major else 1], v.shape[-1]
        # Padded query rows are zero with dO = 0 (so dS = 0 there whatever P is); lse and D pad with 0, keeping P
        # finite.
        d_out = self._layout(pad_axis(pad_axis(d_out.astype(queries[0].dtype), 1, tp), 3, ep))
        lses = [self._rows_in(lse * LOG2E, tp) for lse in lses]
        rowsums = [self._rows_in(r, tp) for r in rowsums]
        lam = None if lam is None else jnp.asarray(lam, jnp.float32)
        d_queries, d_keys, dv = self.kernel_backward(queries, keys, v, lam, seg, d_out, lses, rowsums, cfg)
        return ([self._layout(x)[:, :t, :, :d] for x in d_queries], [self._layout(x)[:, :s, :, :d] for x in d_keys],
                self._layout(dv)[:, :s, :, :e])

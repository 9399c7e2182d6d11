"""The fused kernels on one block of a split sequence, as context parallelism calls them (`context_parallel.py`;
docs/kernels.md, "On a block of a split sequence"), with two maps (DIFF) or one (the standard op).

    outs, lses = blocks.forward(queries, keys, v, causal=..., q_segment_ids=..., kv_segment_ids=...)
    d_queries, d_keys, d_v = blocks.backward(queries, keys, v, lam, d_out, lses, rowsums, causal=..., ...)

`causal`: the diagonal block (Tq == Tk), else every key is visible but for segment ids. forward: per map, the block's
normalised output O_i in float32 (the maps are subtracted only after the merge, where bf16 rounding would be
amplified) and natural-log log-sum-exp [B, H, Tq]. backward: the block's share of the gradients from the *global*
log-sum-exps and D_i = rowsum(dO ∘ O_i), with which the kernels' own backward serves unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from diffjax.kernels.common import LOG2E, check_shapes, pad_axis, prepare


@dataclasses.dataclass(frozen=True)
class FusedBlocks:
    """A platform's fused kernels (`pallas_gpu`, `pallas_tpu`: their `_forward` and `_backward_kernels`) as block
    functions; default_blocks(q1): its block sizes; heads_major: [B, H, T, d] arrays and [B, H, T, 1] row statistics
    (TPU) rather than [B, T, H, d] and [B, H, T]."""

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
        # Padded query rows have dO = 0 (so dS = 0 whatever P is); lse and D pad with 0, keeping P finite.
        d_out = self._layout(pad_axis(pad_axis(d_out.astype(queries[0].dtype), 1, tp), 3, ep))
        lses = [self._rows_in(lse * LOG2E, tp) for lse in lses]
        rowsums = [self._rows_in(r, tp) for r in rowsums]
        lam = None if lam is None else jnp.asarray(lam, jnp.float32)
        d_queries, d_keys, dv = self.kernel_backward(queries, keys, v, lam, seg, d_out, lses, rowsums, cfg)
        return ([self._layout(x)[:, :t, :, :d] for x in d_queries], [self._layout(x)[:, :s, :, :d] for x in d_keys],
                self._layout(dv)[:, :s, :, :e])

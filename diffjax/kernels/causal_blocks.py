"""Causal attention in query blocks that skip the masked keys: the reference math, less of it (CPU).

The queries are cut into blocks of `BLOCK_Q` rows and block i reads only the keys up to its own last position: one
`reference.masked_*` call per block, whose softmax sees all its visible keys at once (no online rescaling), so the
result is the reference's up to float32 summation order. n blocks compute (n + 1) / 2n of the square's logits (62.5 %
at n = 4). Pallas runs on CPU only in slow interpret mode; XLA:CPU compiles these einsums to its matmul calls.
Non-causal attention, T ≠ S and sequences of one block are the reference.
"""

from __future__ import annotations

import jax.numpy as jnp

from diffjax.kernels import reference
from diffjax.kernels.impl import Impl

BLOCK_Q = 128  # query rows per block: large enough that each block's matmuls stay efficient on a CPU


def _block_mask(batch: int, start: int, end: int, segment_ids):
    """[B, 1, end − start, end]: queries start..end−1 against keys 0..end−1, causal and within documents."""
    mask = reference.make_mask(batch, end - start, end, causal=True, q_offset=start)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, start:end, None] == segment_ids[:, None, None, :end])
    return mask


def _over_blocks(masked_fn, qs, ks, rest, segment_ids, block_q: int):
    """masked_fn(*q blocks, *k prefixes, *rest, mask) per query block, concatenated along T (float32)."""
    b, t = qs[0].shape[:2]
    outs = []
    for start in range(0, t, block_q):
        end = min(start + block_q, t)
        outs.append(masked_fn(*(q[:, start:end] for q in qs), *(k[:, :end] for k in ks), *rest(end),
                              _block_mask(b, start, end, segment_ids)))
    return jnp.concatenate(outs, axis=1)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, interpret=False,
                   block_q: int | None = None):
    t, s, block_q = q1.shape[1], k1.shape[1], block_q or BLOCK_Q
    if not causal or t != s or t <= block_q:
        return reference.diff_attention(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids)
    return _over_blocks(reference.masked_diff_attention, (q1, q2), (k1, k2), lambda end: (v[:, :end], lam),
                        segment_ids, block_q).astype(q1.dtype)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, interpret=False, block_q: int | None = None):
    t, s, block_q = q.shape[1], k.shape[1], block_q or BLOCK_Q
    if not causal or t != s or t <= block_q:
        return reference.attention(q, k, v, causal=causal, segment_ids=segment_ids, sinks=sinks)
    return _over_blocks(lambda q, k, v, mask: reference.masked_attention(q, k, v, mask, sinks), (q,), (k,),
                        lambda end: (v[:, :end],), segment_ids, block_q).astype(q.dtype)


IMPL = Impl(attention, diff_attention, features=("sinks",))  # named only: faster than "xla" on a CPU for T > 128

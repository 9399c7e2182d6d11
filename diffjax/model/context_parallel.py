"""Context parallelism's sequence layout (docs/design.md §3, "Context parallelism").

Under a mesh whose `context` axis has N > 1 devices, DecoderLM works on the sequence in the load-balanced order of
MaxText's `context_parallel_load_balance`: the sequence is cut into 2N chunks and device i holds chunks i and
2N−1−i, so under causal attention every device has the same share of early (few keys) and late (many keys)
queries, and none idles while another works.

    size(t)             N when a length-t sequence is split under the current mesh, else 1
    to_layout(x, axis)  natural order -> the layout (identity when size(t) == 1); from_layout: back
    index(t)            every token's place in the natural order, in the layout (the attention op's causal mask)

DecoderLM permutes tokens, positions and segment ids at its start — positions move with their tokens, so RoPE sees
global positions — and its output back at its end, unless the caller keeps the layout (`keep_layout=True`): the
losses do, moving their targets (already shifted by the data pipeline: targets[t] = tokens[t + 1]) with the
tokens, so only a [B, T] per-token result is moved back, never [B, T, D] hidden states or logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "context"  # the mesh axis (diffjax.sharding.AXES)


def size(t: int) -> int:
    """N: the `context` devices a sequence of length `t` is split over under the current mesh; 1 without a mesh,
    with a context axis of 1, or when 2N does not divide t (an evaluation's odd length: it runs unsplit, the
    context axis then repeating the work)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    n = mesh.shape[AXIS]
    return n if n > 1 and t % (2 * n) == 0 else 1


def to_layout(x, axis: int = 1):
    """Natural order -> load-balanced layout along `axis`: [chunk 0, chunk 2N−1, chunk 1, chunk 2N−2, …]."""
    n = size(x.shape[axis])
    if n == 1:
        return x
    halves = _chunked(x, axis, (2, n))  # [..., 2, N, c, ...]: chunks 0..N−1, then N..2N−1
    first = lax.index_in_dim(halves, 0, axis, keepdims=False)
    last = jnp.flip(lax.index_in_dim(halves, 1, axis, keepdims=False), axis)  # chunks 2N−1..N
    return jnp.stack([first, last], axis=axis + 1).reshape(x.shape)  # [..., N, 2, c, ...]: device-major


def from_layout(x, axis: int = 1):
    """The inverse of `to_layout`."""
    n = size(x.shape[axis])
    if n == 1:
        return x
    pairs = _chunked(x, axis, (n, 2))
    first = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    last = jnp.flip(lax.index_in_dim(pairs, 1, axis + 1, keepdims=False), axis)
    return jnp.stack([first, last], axis=axis).reshape(x.shape)


def index(t: int):
    """int32 [t]: the natural-order index of each position of the layout."""
    return to_layout(jnp.arange(t, dtype=jnp.int32), axis=0)


def _chunked(x, axis: int, lead: tuple[int, int]):
    c = x.shape[axis] // (lead[0] * lead[1])
    return x.reshape(*x.shape[:axis], *lead, c, *x.shape[axis + 1:])

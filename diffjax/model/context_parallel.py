"""Context parallelism's load-balanced sequence layout: 2N chunks, device i holding chunks i and 2N−1−i, so every
device has the same share of early and late queries under causal attention (docs/design.md §3, "Context
parallelism")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "context"  # the mesh axis (diffjax.sharding.AXES)


def size(t: int) -> int:
    """N: the `context` devices a length-`t` sequence is split over under the current mesh; 1 without one, or when
    2N does not divide t (it runs unsplit)."""
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

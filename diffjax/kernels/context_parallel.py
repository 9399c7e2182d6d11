"""Attention across a sequence split over a mesh axis (context parallelism): per-shard functions, called inside a
`jax.shard_map` that is manual over that axis (`diffjax.model.attention.attention_op`).

    attention(q, k, v, *, index, segment_ids, axis_name, strategy, causal=True)
    diff_attention(q1, q2, k1, k2, v, lam, *, index, segment_ids, axis_name, strategy, causal=True)

Each device holds T/N of the queries, keys and values (N: the axis size) in any order: `index` [T/N] gives every
local token's place in the unsplit sequence, so the causal mask is the global one (`index_q >= index_k`), and
`segment_ids` [B, T/N] keep packed documents apart across shards too. Output: the local queries' rows, q's dtype.

- `all_gather`: K, V, their indices and segment ids gathered over the axis, then one reference attention of the
  local queries against the whole sequence (the oracle's math with an explicit mask). Per device: the whole
  sequence's K/V and a [T/N, T] map per head.
- `ring`: N steps; at each the local queries attend to the K/V block this device holds, merged into running
  (max, sum, accumulator) statistics — one set per softmax map, so DIFF keeps two sets that share V —, and the block
  moves on to the next device (`lax.ppermute`). Its backward is a custom VJP: the blocks go around again with their
  dK, dV beside them, from the saved outputs and log-sum-exps. Per device: two K/V blocks and a [T/N, T/N] map per
  head at a time, forward and backward.

Both compute every block densely with the XLA reference (the fused kernels take no key positions other than their
own queries', so they cannot take a gathered or passed block; docs/kernels.md). With the load-balanced layout
(`diffjax.model.context_parallel`) every device holds the same mix of early and late tokens, so each does the same
work under a block-skipping kernel too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from diffjax.kernels import reference

STRATEGIES = ("all_gather", "ring")


def attention(q, k, v, *, index, segment_ids, axis_name: str, strategy: str, causal: bool = True):
    out = _split(strategy, [(q, k)], v, None, index, segment_ids, axis_name, causal)
    return out.astype(q.dtype)


def diff_attention(q1, q2, k1, k2, v, lam, *, index, segment_ids, axis_name: str, strategy: str,
                   causal: bool = True):
    out = _split(strategy, [(q1, k1), (q2, k2)], v, lam, index, segment_ids, axis_name, causal)
    return out.astype(q1.dtype)


def _split(strategy, maps, v, lam, index, segment_ids, axis_name, causal):
    """float32 output of one (standard: `lam` None) or two (DIFF) softmax maps [(q, k), ...] over a shared V."""
    if strategy == "all_gather":
        return _all_gather(maps, v, lam, index, segment_ids, axis_name, causal)
    if strategy == "ring":
        return _ring(maps, v, lam, index, segment_ids, axis_name, causal)
    raise ValueError(f"unknown context-parallel strategy {strategy!r}; choose one of {STRATEGIES}")


def _mask(q_index, k_index, q_segments, k_segments, causal):
    """[B or 1, 1, Tq, Tk]: True where a local query may attend to a key, from global indices and segment ids."""
    mask = jnp.ones((1, 1, q_index.shape[0], k_index.shape[0]), bool)
    if causal:
        mask = mask & (q_index[:, None] >= k_index[None, :])[None, None]
    if q_segments is not None:
        mask = mask & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    return mask


def _all_gather(maps, v, lam, index, segment_ids, axis_name, causal):
    def gather(x, axis):
        return None if x is None else lax.all_gather(x, axis_name, axis=axis, tiled=True)

    mask = _mask(index, gather(index, 0), segment_ids, gather(segment_ids, 1), causal)
    keys = [gather(k, 1) for _, k in maps]
    if lam is None:
        return reference.masked_attention(maps[0][0], keys[0], gather(v, 1), mask)
    return reference.masked_diff_attention(maps[0][0], maps[1][0], *keys, gather(v, 1), lam, mask)


def _ring(maps, v, lam, index, segment_ids, axis_name, causal):
    """The ring with its own backward pass (a custom VJP), flash-attention style: the forward keeps each map's
    normalised output and log-sum-exp; the backward passes every block around the ring again, its dK, dV
    accumulating beside it, and sends them home at the end. No step keeps a map or a received block for later."""
    n = lax.axis_size(axis_name)

    def rotate(tree):  # device j's share goes to device j + 1
        return jax.tree.map(lambda x: lax.ppermute(x, axis_name, [(j, (j + 1) % n) for j in range(n)]), tree)

    def around(state, block, visit):
        """`state, block = visit(state, block)` for the local block and each of the N − 1 arriving after it; the
        final state, and the block as the last visit left it (held by the next device)."""
        state, block = visit(state, block)

        def step(carry, _):
            state, block = carry
            return visit(state, rotate(block)), None

        (state, block), _ = lax.scan(step, (state, block), None, length=n - 1)
        return state, block

    def forward(queries, keys, v, index, segment_ids):
        b, t, h, _ = queries[0].shape
        # Per map: running max m and sum l [B, H, Tq] of the exponentiated logits, accumulator Σ exp(s − m)·V.
        stats = [(jnp.full((b, h, t), reference.NEG_INF, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
                  jnp.zeros((b, t, h, v.shape[-1]), jnp.float32)) for _ in queries]

        def visit(stats, block):
            keys, v, k_index, k_segments = block
            mask = _mask(index, k_index, segment_ids, k_segments, causal)
            return [_merge_block(s, q, k, v, mask) for s, q, k in zip(stats, queries, keys, strict=True)], block

        stats, _ = around(stats, (keys, v, index, segment_ids), visit)
        outs = [acc / jnp.swapaxes(total, 1, 2)[..., None] for _, total, acc in stats]  # [B, Tq, H, e]
        return outs, [m + jnp.log(total) for m, total, _ in stats]  # log-sum-exp [B, H, Tq]

    def combine(outs, lam):
        return outs[0] if lam is None else outs[0] - jnp.asarray(lam, jnp.float32) * outs[1]

    @jax.custom_vjp
    def ring(queries, keys, v, lam, index, segment_ids):
        return combine(forward(queries, keys, v, index, segment_ids)[0], lam)

    def ring_fwd(queries, keys, v, lam, index, segment_ids):
        outs, lses = forward(queries, keys, v, index, segment_ids)
        return combine(outs, lam), (queries, keys, v, lam, index, segment_ids, outs, lses)

    def ring_bwd(residuals, d_out):
        queries, keys, v, lam, index, segment_ids, outs, lses = residuals
        d_out = d_out.astype(jnp.float32)
        d_outs = [d_out] if lam is None else [d_out, -jnp.asarray(lam, jnp.float32) * d_out]

        def block_loss(queries, keys, v, mask):
            """Σ_j dO_j · Σ_s p_js (v_s − o_j) with p_js = exp(s_js − lse_j), o_j and lse_j held fixed: its gradients
            are this block's share of dQ, dK, dV (the −o_j term is the softmax's normalisation: dS = P ∘ (dP −
            rowsum(dO ∘ O)))."""
            total = 0.0
            for q, k, o, lse, do in zip(queries, keys, outs, lses, d_outs, strict=True):
                p = jnp.exp(reference.attention_logits(q, k, mask) - lse[..., None])
                pv = reference.apply_probs(p, v) - jnp.swapaxes(jnp.sum(p, -1), 1, 2)[..., None] * o
                total = total + jnp.sum(pv * do)
            return total

        def visit(d_queries, travelling):  # a block and its gradient accumulators travel together
            (keys, v, k_index, k_segments), d_block = travelling
            mask = _mask(index, k_index, segment_ids, k_segments, causal)
            d_q, d_k, d_v = jax.grad(block_loss, argnums=(0, 1, 2))(queries, keys, v, mask)
            return (jax.tree.map(jnp.add, d_queries, d_q),
                    (travelling[0], jax.tree.map(jnp.add, d_block, (d_k, d_v))))

        zeros = lambda xs: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), xs)  # noqa: E731
        d_queries, (_, d_block) = around(zeros(queries), ((keys, v, index, segment_ids), zeros((keys, v))), visit)
        d_keys, d_v = rotate(d_block)  # held by the next device: one more step brings them home
        d_lam = None if lam is None else -jnp.sum(outs[1] * d_out)  # this shard's part; shard_map sums the parts
        cast = lambda grads, like: [g.astype(x.dtype) for g, x in zip(grads, like, strict=True)]  # noqa: E731
        return cast(d_queries, queries), cast(d_keys, keys), d_v.astype(v.dtype), d_lam, None, None

    ring.defvjp(ring_fwd, ring_bwd)
    return ring([q for q, _ in maps], [k for _, k in maps], v, lam, index, segment_ids)


def _merge_block(stats, q, k, v, mask):
    """One online-softmax update with a key block. Masked logits are NEG_INF (finite): a row with no key in this
    block adds exp(0) terms under a max of NEG_INF, which the first real key scales by exp(NEG_INF − m) = 0 (every
    query sees at least itself). The running max carries no gradient: the result does not depend on it."""
    m, total, acc = stats
    logits = reference.attention_logits(q, k, mask)  # [B, H, Tq, Tk] float32
    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(logits, axis=-1)))
    p = jnp.exp(logits - m_new[..., None])
    scale = jnp.exp(m - m_new)
    acc = acc * jnp.swapaxes(scale, 1, 2)[..., None] + reference.apply_probs(p, v)
    return m_new, total * scale + jnp.sum(p, axis=-1), acc

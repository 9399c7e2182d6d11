"""Attention across a sequence split over a mesh axis (context parallelism): per-shard functions, called inside a
`jax.shard_map` manual over that axis (`diffjax.model.attention.attention_op`; docs/design.md §3).

Each device holds T/N of the queries, keys and values in the load-balanced layout of `diffjax.model.context_parallel`
(device i: chunks i and 2N−1−i of 2N): `index` [T/N] gives every local token's place in the unsplit sequence (the
causal mask is `index_q >= index_k`), `segment_ids` [B, T/N] keep packed documents apart across shards. `all_gather`
gathers K and V over the axis; `ring` passes the blocks on (`lax.ppermute`) while computing on them. Per block, the
platform's fused kernels (`kernels.split_blocks`, `fused_blocks.py`) or the XLA reference; output: the local
queries' rows, q's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diffjax import kernels
from diffjax.kernels import reference
from diffjax.kernels.common import combine, lambda_grad, pad_axis

STRATEGIES = ("all_gather", "ring")


def attention(q, k, v, **split):
    """Standard attention of the local queries over the whole sequence; keywords: `_split`'s."""
    return _split("attention", [(q, k)], v, None, **split)


def diff_attention(q1, q2, k1, k2, v, lam, **split):
    """DIFF attention of the local queries over the whole sequence; keywords: `_split`'s."""
    return _split("diff_attention", [(q1, k1), (q2, k2)], v, lam, **split)


def _split(op, maps, v, lam, *, index, axis_name: str, strategy: str, segment_ids=None, causal: bool = True,
           impl: str = "auto", interpret: bool = False):
    """`op` of one (standard: `lam` None) or two (DIFF) softmax maps [(q, k), ...] over a shared V, in q's dtype."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {strategy!r}; choose one of {STRATEGIES}")
    dtype = maps[0][0].dtype
    blocks = kernels.split_blocks(impl, op, interpret=interpret, dtype=dtype, label=f"({strategy} over {axis_name})")
    if strategy == "all_gather" and blocks is None:
        out = _all_gather(maps, v, lam, index=index, segment_ids=segment_ids, axis_name=axis_name, causal=causal)
    else:
        steps = (functools.partial(_ReferenceSteps, causal=causal) if blocks is None else
                 functools.partial(_FusedSteps, blocks, causal=causal, axis_name=axis_name))
        transport = _Ring(axis_name) if strategy == "ring" else _Gathered(axis_name)
        out = _blockwise(maps, v, lam, index=index, segment_ids=segment_ids, axis_name=axis_name, steps=steps,
                         transport=transport)
    return out.astype(dtype)


class Block(NamedTuple):
    """One device's share of the keys and values, as the split visits it (`_Ring` passes it on, `_Gathered` all)."""
    keys: list  # [B, T/N, H_kv, d] per softmax map
    v: jax.Array  # [B, T/N, H_kv, e]
    index: jax.Array  # [T/N]: each key's place in the unsplit sequence
    segment_ids: jax.Array | None  # [B, T/N]
    owner: jax.Array  # the device it belongs to (its `lax.axis_index`)


def _mask(q_index, k_index, q_segments, k_segments, causal):
    """[B or 1, 1, Tq, Tk]: True where a local query may attend to a key, from global indices and segment ids."""
    mask = jnp.ones((1, 1, q_index.shape[0], k_index.shape[0]), bool)
    if causal:
        mask = mask & (q_index[:, None] >= k_index[None, :])[None, None]
    if q_segments is not None:
        mask = mask & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    return mask


def _all_gather(maps, v, lam, *, index, segment_ids, axis_name, causal):
    def gather(x, axis):
        return None if x is None else lax.all_gather(x, axis_name, axis=axis, tiled=True)

    mask = _mask(index, gather(index, 0), segment_ids, gather(segment_ids, 1), causal)
    keys = [gather(k, 1) for _, k in maps]
    if lam is None:
        return reference.masked_attention(maps[0][0], keys[0], gather(v, 1), mask)
    return reference.masked_diff_attention(maps[0][0], maps[1][0], *keys, gather(v, 1), lam, mask)


def _blockwise(maps, v, lam, *, index, segment_ids, axis_name, steps, transport):
    """The local queries over every device's `Block`, flash-attention style, under a custom VJP: the forward keeps
    each map's normalised output and log-sum-exp, the backward visits every block again with its dK, dV beside it.
    `steps(index, segment_ids)` computes one (made inside the custom VJP's functions: they may not close over traced
    values)."""

    def forward(queries, keys, v, index, segment_ids):
        b, t, h, _ = queries[0].shape
        per_block = steps(index, segment_ids)
        stats = [(jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), jnp.full((b, h, t), reference.NEG_INF, jnp.float32))
                 for _ in queries]

        def visit(stats, block):
            return [_merge(s, new) for s, new in zip(stats, per_block.forward(queries, block), strict=True)]

        stats = transport.forward(stats, Block(keys, v, index, segment_ids, owner=lax.axis_index(axis_name)), visit)
        return [o for o, _ in stats], [lse for _, lse in stats]  # [B, Tq, H, e], log-sum-exp [B, H, Tq]

    @jax.custom_vjp
    def blockwise(queries, keys, v, lam, index, segment_ids):
        return combine(forward(queries, keys, v, index, segment_ids)[0], lam)

    def blockwise_fwd(queries, keys, v, lam, index, segment_ids):
        outs, lses = forward(queries, keys, v, index, segment_ids)
        return combine(outs, lam), (queries, keys, v, lam, index, segment_ids, outs, lses)

    def blockwise_bwd(residuals, d_out):
        queries, keys, v, lam, index, segment_ids, outs, lses = residuals
        d_out = d_out.astype(jnp.float32)
        per_block = steps(index, segment_ids)

        def visit(d_queries, block):
            d_q, d_block = per_block.backward(queries, block, lam, outs, lses, d_out)
            return jax.tree.map(jnp.add, d_queries, d_q), d_block

        zeros = lambda xs: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), xs)  # noqa: E731
        local = Block(keys, v, index, segment_ids, owner=lax.axis_index(axis_name))
        d_queries, (d_keys, d_v) = transport.backward(zeros(queries), local, zeros((keys, v)), visit)
        d_lam = lambda_grad(jnp.sum(outs[-1] * d_out, -1), lam)  # this shard's part; shard_map sums the parts
        cast = lambda grads, like: [g.astype(x.dtype) for g, x in zip(grads, like, strict=True)]  # noqa: E731
        return cast(d_queries, queries), cast(d_keys, keys), d_v.astype(v.dtype), d_lam, None, None

    blockwise.defvjp(blockwise_fwd, blockwise_bwd)
    return blockwise([q for q, _ in maps], [k for _, k in maps], v, lam, index, segment_ids)


def _merge(stats, block_stats):
    """Running (output, log-sum-exp) of one map merged with a block's own. A row that sees none of the block's keys
    has a finite block log-sum-exp near NEG_INF, so weight 0 once its own block (always first) is merged."""
    (out, lse), (out_b, lse_b) = stats, block_stats
    new = jnp.logaddexp(lse, lse_b)
    weight = lambda x: jnp.swapaxes(jnp.exp(x - new), 1, 2)[..., None]  # noqa: E731  [B, H, Tq] -> [B, Tq, H, 1]
    return out * weight(lse) + out_b * weight(lse_b), new


class _ReferenceSteps:
    """Any block in XLA, masked from global indices and segment ids."""

    def __init__(self, index, segment_ids, *, causal):
        self.index, self.segment_ids, self.causal = index, segment_ids, causal

    def _mask(self, block):
        return _mask(self.index, block.index, self.segment_ids, block.segment_ids, self.causal)

    def forward(self, queries, block):
        mask, stats = self._mask(block), []
        for q, k in zip(queries, block.keys, strict=True):
            logits = reference.attention_logits(q, k, mask)  # [B, H, Tq, Tk] float32
            lse = jax.nn.logsumexp(logits, axis=-1)
            stats.append((reference.apply_probs(jnp.exp(logits - lse[..., None]), block.v), lse))
        return stats

    def backward(self, queries, block, lam, outs, lses, d_out):
        mask = self._mask(block)
        d_outs = [d_out] if lam is None else [d_out, -jnp.asarray(lam, jnp.float32) * d_out]

        def block_loss(queries, keys, v):
            """Σ_j dO_j · Σ_s p_js (v_s − o_j), p_js = exp(s_js − lse_j), o_j and lse_j fixed: its gradients are this
            block's share of dQ, dK, dV (−o_j: the softmax's normalisation, dS = P ∘ (dP − rowsum(dO ∘ O)))."""
            total = 0.0
            for q, k, o, lse, do in zip(queries, keys, outs, lses, d_outs, strict=True):
                p = jnp.exp(reference.attention_logits(q, k, mask) - lse[..., None])
                pv = reference.apply_probs(p, v) - jnp.swapaxes(jnp.sum(p, -1), 1, 2)[..., None] * o
                total = total + jnp.sum(pv * do)
            return total

        d_q, d_k, d_v = jax.grad(block_loss, argnums=(0, 1, 2))(queries, block.keys, block.v)
        return d_q, (d_k, d_v)


class _FusedSteps:
    """The fused block kernels (`fused_blocks.FusedBlocks`) on the layout's three kinds of block, so no masked chunk
    pair is computed (docs/design.md §3): the own block, causal on the diagonal; an earlier owner's first chunk, full
    to both local chunks; a later owner's block, full to the second local chunk. Non-causal: every block whole."""

    def __init__(self, blocks, index, segment_ids, *, causal, axis_name):
        del index  # the layout's: a block's kind follows from its owner
        self.blocks, self.segment_ids, self.causal = blocks, segment_ids, causal
        self.me = lax.axis_index(axis_name)

    def _kinds(self, block, own, earlier, later):
        if not self.causal:
            return own(full=True)
        kind = jnp.where(block.owner == self.me, 0, jnp.where(block.owner < self.me, 1, 2))
        return lax.switch(kind, [lambda: own(full=False), earlier, later])

    def forward(self, queries, block):
        keys, v, k_segments = block.keys, block.v, block.segment_ids
        c = queries[0].shape[1] // 2
        call = functools.partial(self.blocks.forward, causal=False)

        def own(full):
            return call(queries, keys, v, causal=not full, **_segments(self.segment_ids, k_segments))

        def earlier():
            return call(queries, _first(keys, c), _first(v, c), **_segments(self.segment_ids, _first(k_segments, c)))

        def later():
            outs, lses = call(_second(queries, c), keys, v, **_segments(_second(self.segment_ids, c), k_segments))
            return ([_pad_front(o, c, 0.0, axis=1) for o in outs],
                    [_pad_front(lse, c, reference.NEG_INF, axis=2) for lse in lses])

        outs, lses = self._kinds(block, own, earlier, later)
        return list(zip(outs, lses, strict=True))

    def backward(self, queries, block, lam, outs, lses, d_out):
        keys, v, k_segments = block.keys, block.v, block.segment_ids
        c = queries[0].shape[1] // 2
        rowsums = [jnp.swapaxes(jnp.sum(d_out * o, -1), 1, 2) for o in outs]  # D_i [B, H, Tq]
        call = functools.partial(self.blocks.backward, lam=lam, causal=False)
        f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731

        def own(full):
            return f32(call(queries, keys, v, d_out=d_out, lses=lses, rowsums=rowsums, causal=not full,
                            **_segments(self.segment_ids, k_segments)))

        def earlier():
            d_q, d_k, d_v = f32(call(queries, _first(keys, c), _first(v, c), d_out=d_out, lses=lses, rowsums=rowsums,
                                     **_segments(self.segment_ids, _first(k_segments, c))))
            return d_q, [pad_axis(x, 1, 2 * c) for x in d_k], pad_axis(d_v, 1, 2 * c)  # zeros behind

        def later():
            second = lambda rows: [r[:, :, c:] for r in rows]  # noqa: E731  [B, H, Tq]
            d_q, d_k, d_v = f32(call(_second(queries, c), keys, v, d_out=d_out[:, c:], lses=second(lses),
                                     rowsums=second(rowsums), **_segments(_second(self.segment_ids, c), k_segments)))
            return [_pad_front(x, c, 0.0, axis=1) for x in d_q], d_k, d_v

        d_q, d_k, d_v = self._kinds(block, own, earlier, later)
        return d_q, (d_k, d_v)


def _segments(q_segments, k_segments):
    return {} if q_segments is None else {"q_segment_ids": q_segments, "kv_segment_ids": k_segments}


def _first(x, c):  # the first c positions (axis 1) of an array or each of a list; None stays None
    return jax.tree.map(lambda a: a[:, :c], x)


def _second(x, c):
    return jax.tree.map(lambda a: a[:, c:], x)


def _pad_front(x, c, value, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (c, 0)
    return jnp.pad(x, pad, constant_values=value)


class _Ring:
    """Each block goes around the axis (`lax.ppermute` to the next device), N visits, the local block first, sent on
    while this device computes on it: they share no data, so XLA runs the permute asynchronously around the kernels
    (`tests/test_aot.py` checks). Its gradients travel one step behind it. Needs N ≥ 2."""

    def __init__(self, axis_name):
        self.axis_name = axis_name

    def _rotate(self, tree):  # device j's share goes to device j + 1
        n = lax.axis_size(self.axis_name)
        return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, [(j, (j + 1) % n) for j in range(n)]), tree)

    def _steps(self, step, carry, length):
        return lax.scan(lambda carry, _: (step(carry), None), carry, None, length=length)[0]

    def forward(self, state, local, visit):
        def step(carry):
            state, block = carry
            arriving = self._rotate(block)
            return visit(state, block), arriving

        state, last = self._steps(step, (state, local), lax.axis_size(self.axis_name) - 1)
        return visit(state, last)

    def backward(self, d_queries, local, d_local, visit):
        """While computing on a block, device i sends on the gradient sum of the block it visited before, which
        device i + 1 is visiting now, so no send of a step waits for that step's compute (XLA would combine a send
        of the new sum with the block's into one permute that waits)."""
        def visit_block(d_queries, block, d_received):
            d_queries, d_here = visit(d_queries, block)
            return d_queries, jax.tree.map(jnp.add, d_received, d_here)

        def step(carry):
            d_queries, block, d_previous = carry
            arriving, d_received = self._rotate((block, d_previous))
            d_queries, d_block = visit_block(d_queries, block, d_received)
            return d_queries, arriving, d_block

        arriving = self._rotate(local)  # the local block first: nothing to receive for it
        d_queries, d_block = visit_block(d_queries, local, d_local)
        d_queries, last, d_block = self._steps(step, (d_queries, arriving, d_block),
                                               lax.axis_size(self.axis_name) - 2)
        d_queries, d_block = visit_block(d_queries, last, self._rotate(d_block))  # the last block: nothing to send on
        return d_queries, self._rotate(d_block)  # held by the next device, whose block it is


class _Gathered:
    """Every block gathered over the axis at once (`lax.all_gather`), visited in the ring's order; the blocks'
    gradients are summed back to their owners (`lax.psum_scatter`)."""

    def __init__(self, axis_name):
        self.axis_name = axis_name

    def _visits(self, carry, local, visit):
        n, me = lax.axis_size(self.axis_name), lax.axis_index(self.axis_name)
        blocks = jax.tree.map(lambda x: lax.all_gather(x, self.axis_name), local)  # [N, ...] per leaf

        def step(s, carry):
            owner = lax.rem(me - s + n, n)  # as the ring visits: own block first, then the previous device's, …
            return visit(carry, owner, jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, owner, keepdims=False),
                                                    blocks))

        return lax.fori_loop(0, n, step, carry)

    def forward(self, state, local, visit):
        return self._visits(state, local, lambda state, _, block: visit(state, block))

    def backward(self, d_queries, local, d_local, visit):
        n = lax.axis_size(self.axis_name)

        def with_gradients(carry, owner, block):
            d_queries, d_blocks = carry
            d_queries, d_here = visit(d_queries, block)
            return d_queries, jax.tree.map(lambda a, d: a.at[owner].add(d), d_blocks, d_here)

        d_all = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), d_local)
        d_queries, d_all = self._visits((d_queries, d_all), local, with_gradients)
        return d_queries, jax.tree.map(lambda x: lax.psum_scatter(x, self.axis_name), d_all)

"""DINT (Cang et al. 2025, "DINT Transformer", arXiv 2501.17486): DIFF's differential attention plus an "integral"
term, a global importance score of every key taken from the first map, that brings each row's sum back to 1.

Head layout, λ and the headwise norm are DIFF's (`archs/diff.py`): h = n_heads heads; Q, K as 2h (2·n_kv)
sub-heads of d with (2i, 2i+1) = (Q1_i, Q2_i); V as n_kv heads of 2d; λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
(one per layer, the λ_init schedule); O ← RMSNorm_head(O) · (1 − λ_init) unless `model.headwise_norm=false`.
    A_j = softmax(Q_j K_jᵀ / √d + causal mask)
    G[i, j] = (1 / |R_i|) Σ_{m ∈ R_i} A1[m, j],   R_i = {m ≤ i in i's document}
    O = (A1 − λ A2 + λ G) V,   rows of A1 − λ A2 + λ G sum to 1
The paper defines G as the column mean of A1 over all N rows (every row of G the same). Under a causal mask that
cannot be used as is: the mean over rows m > i reads queries from the future (token i's output would depend on
later tokens, and decoding could not reproduce the forward pass), and averaging column j over only the rows that
see it (m ≥ j) would not make rows sum to 1. So row i averages A1 over the rows it has seen, R_i — the paper's
column mean over the prefix x_1..x_i (the last row gets exactly the paper's G): causal, rows sum to 1, and packed
documents stay separate.

Since G V[i] = mean_{m ∈ R_i} (A1 V)[m], the layer never forms G: with O1 = A1 V,
    O = (A1 − λA2) V + λ · cummean(O1)
where cummean (`cumulative_mean`) is a sum over the sequence that restarts at each document's first row, divided
by the rows counted: O(T), where the T × T weights of the mean were O(T²) (documents are contiguous runs of one
segment id, as the data pipeline packs them). Both terms are kernel ops, `op = ("diff_attention", "attention")`:
the DIFF op for (A1 − λA2) V (subtraction in float32, one cast) and the standard op for O1 (V of 2d), so
`model.attention_impl` takes fused kernels where they exist (an explicit impl must implement both ops; `auto`
picks per op). Decoding keeps O1 per cached position (the KV cache's `o1`) and takes the mask-weighted mean over
the cache (`integral`), so moving the write index back over padding stays exact. Parameters are exactly DIFF's
(same names and shapes).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, register, row_probs, take_rows, uses_headwise_norm
from diffjax.model.archs.diff import ARCH as DIFF
from diffjax.model.archs.diff import differential_inputs
from diffjax.model.attention import attention_op, output_projection


def _row_weights(mask_B1TS):
    """[B, T, S] float32: 1/|R_t| on the rows (positions) s that row t has seen, else 0 (T == S: self-attention;
    decoding: S cache positions)."""
    w = mask_B1TS[:, 0].astype(jnp.float32)
    return w / jnp.sum(w, axis=-1, keepdims=True)  # every row sees itself: never 0 / 0


def integral(mask_B1TS, rows_BSHe):
    """[B, T, H, e] float32: row t's mean of `rows` over the positions it has seen (= G V when rows = A1 V)."""
    return jnp.einsum("bts,bshe->bthe", _row_weights(mask_B1TS), rows_BSHe.astype(jnp.float32),
                      preferred_element_type=jnp.float32)


def cumulative_mean(rows_BTHe, segment_ids=None):
    """`integral` under the causal (document) mask of self-attention, in O(T): [B, T, H, e] float32, row t's mean of
    `rows` over the rows m ≤ t of its document — a cumulative sum that restarts where the segment id changes (each
    document a contiguous run of one id), over the count of rows summed."""
    rows = rows_BTHe.astype(jnp.float32)
    b, t = rows.shape[:2]
    starts = jnp.arange(t)[None, :] == 0
    if segment_ids is not None:
        starts = starts | jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    starts = jnp.broadcast_to(starts, (b, t))

    def segmented_sum(left, right):  # associative: a start on the right discards everything to its left
        (sum_l, start_l), (sum_r, start_r) = left, right
        return jnp.where(start_r[:, :, None, None], sum_r, sum_l + sum_r), start_l | start_r

    sums, _ = lax.associative_scan(segmented_sum, (rows, starts), axis=1)
    index = jnp.arange(t)
    counts = index - lax.cummax(jnp.where(starts, index, 0), axis=1) + 1
    return sums / counts[:, :, None, None].astype(jnp.float32)


def integral_map(mask_B1TS, a1_BHTS, rows=None):
    """G [B, H, T, S] float32 for self-attention maps A1 [B, H, T, T] (G's rows `rows` [B, R] only: [B, H, R, S])."""
    return jnp.einsum("btm,bhms->bhts", take_rows(_row_weights(mask_B1TS), rows), a1_BHTS,
                      preferred_element_type=jnp.float32)


class DintAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, lambda_init, positions, segment_ids=None, decode=False):
        cfg = self.cfg
        (q1, q2, k1, k2, v, lam), mask, positions = differential_inputs(self, cfg, x, lambda_init, positions,
                                                                        segment_ids, decode)
        if decode:
            out = self._decode(q1, q2, k1, k2, v, lam, mask, positions)
        else:
            differential = attention_op(cfg, "diff_attention", q1, q2, k1, k2, v, lam, segment_ids=segment_ids)
            o1 = attention_op(cfg, "attention", q1, k1, v, segment_ids=segment_ids)  # A1 V [B, T, h, 2d]
            out = differential.astype(jnp.float32) + lam * cumulative_mean(o1, segment_ids)
        return output_projection(self, cfg, x, out, norm=uses_headwise_norm(cfg), norm_scale=1.0 - lambda_init)

    def _decode(self, q1, q2, k1, k2, v, lam, mask, positions):
        """(A1 − λA2) V + λ G V over the KV cache: G V needs A1 V of every earlier position, kept per position in
        the cache (like k and v) and averaged with the mask's weights."""
        a1, a2 = reference.attention_probs(q1, k1, mask), reference.attention_probs(q2, k2, mask)
        o1 = reference.apply_probs(a1, v)  # A1 V [B, T, h, 2d], float32
        rows = o1
        sizing = not self.has_variable("cache", "o1")
        cached = self.variable("cache", "o1", jnp.zeros, o1.shape, jnp.float32)  # sized by the init pass
        if not sizing:
            cached.value = lax.dynamic_update_slice_in_dim(cached.value, o1, positions[0, 0], axis=1)
            rows = cached.value
        return reference.apply_probs(reference.differential(a1, a2, lam), v) + lam * integral(mask, rows)


def _flops(cfg: ModelConfig, seq_len: int, causal: bool, backward: bool) -> float:
    """The two kernel ops, in units of h·N²·d: the DIFF op (forward 12, backward 20) and the standard op for A1 V
    with V of 2d (forward 6: S1 2, A1V 4; backward 14: recompute S1 2, dP 4, dV 4, dQ 2, dK 2); the cumulative
    mean is O(N)."""
    units = 18.0 + (34.0 if backward else 0.0)
    return units * cfg.n_heads * seq_len**2 * cfg.head_dim * (0.5 if causal else 1.0)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """The effective map A1 − λA2 + λG (what multiplies V); rows sum to 1. G's row t averages every earlier row of
    A1, so A1 is built whole even for a few `rows`."""
    (q1, k1), (q2, k2) = DIFF.attention_components(cfg, sown).values()
    a1 = reference.attention_probs(q1, k1, mask)
    lam = sown["lambda"]
    return (reference.differential(take_rows(a1, rows, axis=2), row_probs(q2, k2, mask, rows), lam)
            + lam * integral_map(mask, a1, rows))


ARCH = register(Arch(
    name="dint", layer=DintAttention, op=("diff_attention", "attention"), attention_flops=_flops,
    attention_map=_map, attention_components=DIFF.attention_components, headwise_norm=True,
    layer_lambda=DIFF.layer_lambda, map_label="A1 − λA2 + λG"))

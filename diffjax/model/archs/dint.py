"""DINT (Cang et al. 2025, arXiv 2501.17486): DIFF's layer with the map A1 − λA2 + λG, G[i] the mean of A1's rows
m ≤ i in i's document, computed as O = (A1 − λA2) V + λ · cummean(A1 V) (docs/design.md §2, "DINT"). Parameters are
exactly DIFF's."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from diffjax.config import ModelConfig
from diffjax.kernels import reference
from diffjax.model.archs import Arch, register, row_probs, take_rows, uses_headwise_norm
from diffjax.model.archs.diff import ARCH as DIFF
from diffjax.model.archs.diff import differential_inputs, pairs
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
    """`integral` under the causal (document) mask of self-attention, in O(T): a cumulative sum of `rows` that
    restarts where the segment id changes (documents are contiguous), over the count of rows summed."""
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
        sizing = not self.has_variable("cache", "o1")
        cached = self.variable("cache", "o1", jnp.zeros, o1.shape, jnp.float32)  # sized by the init pass
        if not sizing:
            cached.value = lax.dynamic_update_slice_in_dim(cached.value, o1, positions[0, 0], axis=1)
        rows = o1 if sizing else cached.value
        return reference.apply_probs(reference.differential(a1, a2, lam), v) + lam * integral(mask, rows)


def _flops(cfg: ModelConfig, seq_len: int, causal: bool, backward: bool) -> float:
    """The DIFF op plus the standard op for A1 V, in units of h·N²·d (docs/design.md §FLOPs)."""
    units = 18.0 + (34.0 if backward else 0.0)
    return units * cfg.n_heads * seq_len**2 * cfg.head_dim * (0.5 if causal else 1.0)


def _map(cfg: ModelConfig, sown: dict, mask, rows=None):
    """The effective map A1 − λA2 + λG (what multiplies V); rows sum to 1. G's row t averages every earlier row of
    A1, so A1 is built whole even for a few `rows`."""
    (q1, k1), (q2, k2) = pairs(sown).values()
    a1 = reference.attention_probs(q1, k1, mask)
    lam = sown["lambda"]
    return (reference.differential(take_rows(a1, rows, axis=2), row_probs(q2, k2, mask, rows), lam)
            + lam * integral_map(mask, a1, rows))


ARCH = register(Arch(
    name="dint", layer=DintAttention, op=("diff_attention", "attention"), attention_flops=_flops,
    attention_map=_map, attention_logits=DIFF.attention_logits, headwise_norm=True,
    layer_lambda=DIFF.layer_lambda, map_label="A1 − λA2 + λG"))

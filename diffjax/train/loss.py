"""Per-token cross-entropy for training, optionally chunked over positions (`model.loss_chunk`, each chunk under
`jax.checkpoint`) so the [B, T, vocab] float32 logits are never whole; equal to the unchunked loss
(docs/design.md §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diffjax import sharding
from diffjax.config import Config, ModelConfig
from diffjax.model import DecoderLM, context_parallel, output_logits

LOGITS_BUDGET = 256 * 2**20  # bytes of float32 logits per device that `loss_chunk = 0` lets a step hold at once


def resolved_chunk(model: ModelConfig, rows: int, share: int) -> int:
    """Positions per chunk for a device's `rows` sequences of `share` positions: `model.loss_chunk` where set; for 0,
    none where their float32 logits fit LOGITS_BUDGET (byte-level vocabularies, small batches), else the largest
    power of two (≥ 16) dividing the share whose logits do — cl100k's 100,288 columns at size tiny: 32 of 256."""
    if model.loss_chunk:
        return model.loss_chunk
    per_position = rows * model.vocab_size * 4
    if per_position * share <= LOGITS_BUDGET:
        return 0
    chunk = max(16, 1 << (max(LOGITS_BUDGET // per_position, 1).bit_length() - 1))
    while chunk >= 16 and share % chunk:
        chunk //= 2
    return chunk if chunk >= 16 else 0


def batch_shards() -> int:
    """The devices the batch is split over (data × fsdp) under the current mesh; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "data" not in mesh.axis_names:
        return 1
    return sharding.batch_divisor(mesh)


def training_token_losses(params, batch, cfg: Config, lambda_init=None):
    """Per-token cross-entropy [B, T] (float32) of `batch` under `params`; under context parallelism computed in the
    load-balanced layout, only the losses moved back (docs/design.md §3, "Context parallelism")."""
    model = cfg.model
    hidden = DecoderLM(model).apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                                    lambda_init=lambda_init, hidden_only=True, keep_layout=True)
    targets = context_parallel.to_layout(batch["targets"])
    b, t, d = hidden.shape
    g = context_parallel.size(t)  # chunks are cut within each device's share of the sequence, so each stays local
    chunk = resolved_chunk(model, b // batch_shards(), t // g)
    # The checks make chunks divide each device's share of a training sequence; an evaluation's length that they
    # do not divide (`long_context`) is computed unchunked.
    if not chunk or chunk >= t or t % (g * chunk):
        losses = optax.softmax_cross_entropy_with_integer_labels(output_logits(params, hidden, model), targets)
        return context_parallel.from_layout(losses)
    hidden_chunks = jnp.moveaxis(hidden.reshape(b, g, t // (g * chunk), chunk, d), 2, 0)  # [n, B, g, c, D]
    target_chunks = jnp.moveaxis(targets.reshape(b, g, t // (g * chunk), chunk), 2, 0)

    @jax.checkpoint
    def chunk_losses(h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(output_logits(params, h, model), targets)

    losses = jax.lax.map(lambda xs: chunk_losses(*xs), (hidden_chunks, target_chunks))  # [n, B, g, c]
    return context_parallel.from_layout(jnp.moveaxis(losses, 0, 2).reshape(b, t))

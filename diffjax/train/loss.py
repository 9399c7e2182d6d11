"""Per-token cross-entropy for training, optionally chunked over positions so the [B, T, vocab] float32 logits
are never whole (at the paper's vocabulary of 100,288 they are the largest activation of a step).

`model.loss_chunk = c` computes the head and the loss for c positions at a time in a `lax.map`, each chunk under
`jax.checkpoint`: the backward pass recomputes a chunk's logits instead of keeping them, so a step holds
[B, c, vocab] at a time. The result equals the unchunked loss (the same per-token arithmetic).
"""

from __future__ import annotations

import jax
import optax

from diffjax.config import Config
from diffjax.model import DecoderLM, output_logits


def training_token_losses(params, batch, cfg: Config, lambda_init=None):
    """Per-token cross-entropy [B, T] (float32) of `batch` under `params`."""
    model, chunk = cfg.model, cfg.model.loss_chunk
    hidden = DecoderLM(model).apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                                    lambda_init=lambda_init, hidden_only=True)
    if not chunk or chunk >= hidden.shape[1]:
        return optax.softmax_cross_entropy_with_integer_labels(output_logits(params, hidden, model),
                                                               batch["targets"])
    b, t, d = hidden.shape
    hidden_chunks = hidden.reshape(b, t // chunk, chunk, d).swapaxes(0, 1)  # [n, B, c, D]
    target_chunks = batch["targets"].reshape(b, t // chunk, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_losses(h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(output_logits(params, h, model), targets)

    losses = jax.lax.map(lambda xs: chunk_losses(*xs), (hidden_chunks, target_chunks))  # [n, B, c]
    return losses.swapaxes(0, 1).reshape(b, t)

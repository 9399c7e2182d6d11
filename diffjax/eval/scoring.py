"""Scoring of greedy predictions against a batch's loss-masked targets (retrieval, MQAR)."""

from __future__ import annotations

import numpy as np


def predictions(logits) -> np.ndarray:
    """Greedy predictions [B, T] from logits [B, T, V], or predictions passed through."""
    preds = np.asarray(logits)
    return preds.argmax(-1) if preds.ndim == 3 else preds


def answer_hits(logits, batch: dict) -> np.ndarray:
    """Per example: True when the greedy (argmax) prediction is right at every loss-masked position.

    `logits` [B, T, V] (NumPy or JAX) or already-argmaxed predictions [B, T]. For retrieval batches the loss
    mask is exactly the answer tokens, so the mean of this is the paper's retrieval accuracy.
    """
    preds, mask = predictions(logits), np.asarray(batch["loss_mask"]) > 0
    return np.all((preds == np.asarray(batch["targets"])) | ~mask, axis=-1)


def token_accuracy(logits, batch: dict) -> float:
    """Fraction of loss-masked positions predicted right (MQAR's per-query accuracy)."""
    preds, mask = predictions(logits), np.asarray(batch["loss_mask"]) > 0
    return float((preds == np.asarray(batch["targets"]))[mask].mean())

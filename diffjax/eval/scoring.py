"""Greedy predictions of a run's model, streamed in batches under its mesh, and their scoring against a batch's
loss-masked targets (retrieval, needle, MQAR)."""

from __future__ import annotations

import functools

import numpy as np

from diffjax import sharding
from diffjax.config import Config, ModelConfig
from diffjax.model import DecoderLM, context_parallel

INPUTS = ("tokens", "positions", "segment_ids")


@functools.lru_cache(maxsize=8)
def _greedy(cfg: ModelConfig, mesh):
    """The argmax of every position in one forward pass (no decoding) under `mesh`, taken in the context-parallel
    layout so only the [B, T] predictions come back in order."""
    model = DecoderLM(cfg)
    return sharding.MeshJit(lambda p, tokens, positions, segment_ids: context_parallel.from_layout(
        model.apply({"params": p}, tokens, positions, segment_ids, keep_layout=True).argmax(-1)), mesh)


def make_predict(cfg: Config, batch_size: int):
    """`predict(params, batch) -> [n, T]` greedy predictions under the params' mesh, in chunks of `batch_size` rows
    split over its batch axes (the last chunk padded: one compile per length)."""

    def predict(params, batch) -> np.ndarray:
        mesh = sharding.mesh_of(params)
        forward = _greedy(cfg.model, mesh)
        n = len(batch["tokens"])
        size, out = min(batch_size, n), []
        for start in range(0, n, size):
            rows = [np.asarray(batch[k][start:start + size]) for k in INPUTS]
            m = len(rows[0])
            rows = [np.pad(r, [(0, size - m), (0, 0)], mode="edge") for r in rows]
            if size % sharding.batch_divisor(mesh) == 0:
                rows = list(sharding.put_batch(dict(zip(INPUTS, rows, strict=True)), mesh).values())
            out.append(np.asarray(forward(params, *rows))[:m])
        return np.concatenate(out)

    return predict


def predictions(logits) -> np.ndarray:
    """Greedy predictions [B, T] from logits [B, T, V], or predictions passed through."""
    preds = np.asarray(logits)
    return preds.argmax(-1) if preds.ndim == 3 else preds


def answer_hits(logits, batch: dict) -> np.ndarray:
    """Per example: True when the greedy prediction (of logits [B, T, V] or predictions [B, T]) is right at every
    loss-masked position (for retrieval, the answer tokens: its mean is the paper's retrieval accuracy)."""
    preds, mask = predictions(logits), np.asarray(batch["loss_mask"]) > 0
    return np.all((preds == np.asarray(batch["targets"])) | ~mask, axis=-1)


def token_accuracy(logits, batch: dict) -> float:
    """Fraction of loss-masked positions predicted right (MQAR's per-query accuracy)."""
    preds, mask = predictions(logits), np.asarray(batch["loss_mask"]) > 0
    return float((preds == np.asarray(batch["targets"]))[mask].mean())

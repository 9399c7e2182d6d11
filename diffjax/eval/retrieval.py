"""Multi-needle retrieval accuracy by answer depth (paper §3.4, Table 2 / Fig. 5) on the synthetic task.

An example counts as retrieved when the greedy prediction is right at every answer token.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np

from diffjax.config import Config
from diffjax.data.synthetic import DEPTHS, answer_hits, retrieval_examples
from diffjax.model import DecoderLM


def retrieval_accuracy(cfg: Config, params, *, n: int = 64, depths=DEPTHS, seed: int | None = None) -> dict:
    """{"by_depth": {depth: accuracy}, "mean": accuracy} over `n` examples per depth."""
    model = DecoderLM(cfg.model)
    predict = jax.jit(lambda p, b: model.apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"]).argmax(-1))
    params = nn.meta.unbox(params)
    by_depth = {}
    for depth in depths:
        batch = retrieval_examples(cfg.data, n, depth=depth, seed=seed)
        model_inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
        by_depth[float(depth)] = float(np.mean(answer_hits(np.asarray(predict(params, model_inputs)), batch)))
    return {"by_depth": by_depth, "mean": float(np.mean(list(by_depth.values())))}

"""In-loop validation, also the protocol "validation" (`diffjax.eval`): the first `train.eval_batches` batches of
the val split (the same for every fresh iterator), read once and kept on the devices."""

from __future__ import annotations

import functools

from diffjax import distributed, sharding
from diffjax.config import Config
from diffjax.data.pipeline import make_iterator
from diffjax.train.metrics import perplexity
from diffjax.train.step import jit_eval_step


class Validation:
    """`Validation(cfg, mesh, param_shardings)(params)` -> {loss, perplexity, token_accuracy, exact_match}; with
    `eval_fn` (the eval step with a leading member axis) `records(params)` gives one record per member."""

    name = "val"  # the metrics.jsonl split its records are written under

    def __init__(self, cfg: Config, mesh, param_shardings=None, *, eval_fn=None):
        index, count = sharding.process_share(mesh)  # a local mesh (replicated evaluation) reads all of it
        data = make_iterator(cfg.data, split="val", process_index=index, process_count=count)
        try:
            self.batches = [sharding.put_batch(data.next(), mesh) for _ in range(cfg.train.eval_batches)]
        finally:
            data.close()
        self.eval_fn = eval_fn or jit_eval_step(cfg, mesh, param_shardings)

    def totals(self, params) -> dict:
        """The eval step's counts summed over the validation batches (numpy, on every process)."""
        outs = (distributed.fetch(self.eval_fn(params, batch)) for batch in self.batches)
        return functools.reduce(lambda totals, out: {k: totals[k] + out[k] for k in out}, outs)

    def __call__(self, params) -> dict:
        return summarize(self.totals(params))

    def records(self, params) -> list[dict]:
        totals = self.totals(params)
        return [summarize({k: v[i] for k, v in totals.items()}) for i in range(len(totals["tokens"]))]


def summarize(totals: dict) -> dict:
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / tokens
    return {"loss": loss, "perplexity": perplexity(loss), "token_accuracy": float(totals["correct"]) / tokens,
            "exact_match": float(totals["exact_rows"]) / max(float(totals["rows"]), 1.0)}

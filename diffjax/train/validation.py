"""In-loop validation, one evaluator among the protocols (`diffjax.eval`, name "validation").

The validation batches are read once per run (the first `train.eval_batches` batches of the val split, which a
fresh iterator always yields identically) and kept on the devices, so an evaluation never re-reads the corpus.
A single run and a sweep chunk share it: the sweep passes a vmapped eval step and gets one record per member.
"""

from __future__ import annotations

from diffjax import distributed, sharding
from diffjax.config import Config
from diffjax.data.pipeline import make_iterator
from diffjax.train.metrics import perplexity
from diffjax.train.step import jit_eval_step


class Validation:
    """`Validation(cfg, mesh, param_shardings)(params)` -> {loss, perplexity, token_accuracy, exact_match}.

    With `eval_fn=(params, batch) -> summed counts with a leading member axis` (a sweep's vmapped eval step),
    `records(params)` gives one record per member.
    """

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
        totals = None
        for batch in self.batches:
            out = distributed.fetch(self.eval_fn(params, batch))
            totals = out if totals is None else {k: totals[k] + out[k] for k in out}
        return totals

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


"""Protocol "ar_hit": the validation loss split into AR-Hit (the target completes an n-gram seen earlier in the same
document) and Others (paper §3.8, Table 6, after Zoology); the choices made: docs/design.md §6, "Protocol details"."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np

from diffjax.config import Config, ConfigError, ModelConfig
from diffjax.data.pipeline import validation_iterator
from diffjax.eval import Protocol, register, table
from diffjax.train.step import token_losses

SLICES = ("loss", "ar_hit_loss", "others_loss")
HEADERS = ("Valid. loss", "AR-Hit", "Others")


def ar_hit_mask(tokens, targets, segment_ids, n: int = 2) -> np.ndarray:
    """Bool [B, T]: True where targets[b, t] completes an n-gram seen earlier in the same segment of row b."""
    if n < 2:
        raise ConfigError(f"eval.n: an AR-Hit n-gram needs n >= 2 (a key and the recalled token), got {n}")
    tokens, targets, segment_ids = (np.asarray(x) for x in (tokens, targets, segment_ids))
    hits = np.zeros(tokens.shape, bool)
    for b in range(tokens.shape[0]):
        seen, start = set(), 0
        for t in range(tokens.shape[1]):
            seg = segment_ids[b, t]
            if t == 0 or seg != segment_ids[b, t - 1]:
                seen, start = set(), t
            if seg == 0 or t - n + 2 < start:  # padding, or fewer than n−1 key tokens inside this document
                continue
            key = (*tokens[b, t - n + 2:t + 1].tolist(), int(targets[b, t]))
            hits[b, t] = key in seen
            seen.add(key)
    return hits


def sliced_losses(losses, loss_mask, hits) -> dict:
    """Mean losses over all / AR-Hit / Others loss-masked targets and their counts (None for an empty slice)."""
    losses = np.asarray(losses, np.float64)
    mask = np.asarray(loss_mask) > 0
    out = {}
    for name, sel in (("", mask), ("ar_hit_", mask & hits), ("others_", mask & ~hits)):
        count = int(sel.sum())
        out[f"{name}loss"] = float(losses[sel].sum() / count) if count else None
        out[f"{name}tokens"] = count
    return out


@functools.lru_cache(maxsize=8)
def _losses_fn(model: ModelConfig):
    """The jitted per-token loss of a model config (a sweep's members share it)."""
    return jax.jit(lambda p, batch: token_losses(p, batch, Config(model=model))[0])


def run(cfg: Config, params, *, n: int = 2, batches: int | None = None) -> dict:
    """Loss overall, on AR-Hit and on Others targets, with token counts, over `batches` validation batches."""
    batches = cfg.train.eval_batches if batches is None else batches
    if batches <= 0:
        raise ConfigError(f"eval.batches must be positive, got {batches}")
    if n < 2:
        raise ConfigError(f"eval.n: an AR-Hit n-gram needs n >= 2 (a key and the recalled token), got {n}")
    step, params, it = _losses_fn(cfg.model), nn.meta.unbox(params), validation_iterator(cfg.data)
    losses, masks, hits = [], [], []
    for _ in range(batches):
        batch = it.next()
        model_in = {k: batch[k] for k in ("tokens", "targets", "positions", "segment_ids")}
        losses.append(np.asarray(step(params, model_in)))
        masks.append(batch["loss_mask"])
        hits.append(ar_hit_mask(batch["tokens"], batch["targets"], batch["segment_ids"], n))
    result = sliced_losses(np.concatenate(losses), np.concatenate(masks), np.concatenate(hits))
    return {"n": n, "batches": batches, **result,
            "ar_hit_fraction": result["ar_hit_tokens"] / max(result["tokens"], 1)}


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def markdown(results: dict[str, dict]) -> str:
    n = next(iter(results.values()))["n"]
    rows = [[label, *(_fmt(r[k]) for k in SLICES), f"{r['ar_hit_fraction']:.1%} of {r['tokens']} tokens"]
            for label, r in results.items()]
    return (f"Validation loss and fine-grained slices (paper Table 6; AR-Hit = the last token of a {n}-gram seen "
            "earlier in the document)\n\n" + table(["run", *HEADERS, "AR-Hit share"], rows) + "\n")


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    fig, ax = subplots(figsize=(5.5, 3.5))
    width = 0.8 / len(results)
    x = np.arange(len(SLICES))
    for i, (label, r) in enumerate(results.items()):
        values = [np.nan if r[k] is None else r[k] for k in SLICES]
        bars = ax.bar(x + (i - (len(results) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(x, HEADERS)
    ax.set(ylabel="loss (nats / token)", title=f"Fine-grained loss (AR-Hit: {r['n']}-grams)")
    ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("ar_hit", run, markdown=markdown, plot=plot))

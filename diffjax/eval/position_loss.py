"""Protocol "position_loss": the validation next-token loss binned (log-spaced) by the number of tokens of its document
seen, where a long-range gain shows first (docs/design.md §6, "Protocol details")."""

from __future__ import annotations

import flax.linen as nn
import numpy as np

from diffjax import sharding
from diffjax.config import Config, ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.eval import Protocol, register, table
from diffjax.train.loss import training_token_losses


def bin_edges(seq_len: int, bins: int) -> list[int]:
    """Log-spaced integer edges from 1 to seq_len + 1 (so the last bin holds position seq_len), duplicates merged."""
    edges = np.unique(np.round(np.geomspace(1, seq_len + 1, bins + 1)).astype(int))
    return [int(e) for e in edges]


def binned(losses: np.ndarray, seen: np.ndarray, mask: np.ndarray, edges: list[int]) -> dict:
    """{"loss": mean per bin (NaN where empty), "tokens": targets per bin} of the targets `mask` selects, by `seen`."""
    losses, seen, mask = (np.asarray(x, np.float64).ravel() for x in (losses, seen, mask))
    which = np.searchsorted(edges, seen, side="right") - 1  # bin i holds edges[i] <= seen < edges[i + 1]
    n = len(edges) - 1
    keep = (mask > 0) & (which >= 0) & (which < n)
    total = np.bincount(which[keep], weights=losses[keep], minlength=n)
    count = np.bincount(which[keep], minlength=n)
    mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return {"loss": [float(x) for x in mean], "tokens": [int(c) for c in count]}


def run(cfg: Config, params, *, bins: int = 6, batches: int | None = None) -> dict:
    """{"edges": bin edges in seen tokens, "loss": per bin, "tokens": per bin, "overall": the mean loss}."""
    batches = cfg.train.eval_batches if batches is None else batches
    if bins < 1 or batches < 1:
        raise ConfigError(f"eval.bins and eval.batches must be positive, got {bins} and {batches}")
    mesh = sharding.mesh_of(params)
    step = sharding.MeshJit(lambda p, batch: training_token_losses(p, batch, cfg), mesh)
    params = nn.meta.unbox(params)
    index, count = sharding.process_share(mesh)
    data = make_iterator(cfg.data, split="val", process_index=index, process_count=count)
    losses, seen, mask = [], [], []
    try:
        for _ in range(batches):
            batch = data.next()
            losses.append(np.asarray(step(params, sharding.put_batch(batch, mesh))))
            seen.append(batch["positions"] + 1)
            mask.append(batch["loss_mask"])
    finally:
        data.close()
    edges = bin_edges(cfg.data.seq_len, bins)
    losses, seen, mask = np.concatenate(losses), np.concatenate(seen), np.concatenate(mask)
    overall = float((losses * mask).sum() / max(mask.sum(), 1.0))
    return {"edges": edges, **binned(losses, seen, mask, edges), "overall": overall}


def labels(edges: list[int]) -> list[str]:
    return [f"{lo}" if hi == lo + 1 else f"{lo}–{hi - 1}" for lo, hi in zip(edges, edges[1:], strict=False)]


def markdown(results: dict[str, dict]) -> str:
    edges = next(iter(results.values()))["edges"]
    rows = [[label, *(f"{x:.4f}" for x in r["loss"]), f"{r['overall']:.4f}"] for label, r in results.items()]
    return ("Validation loss by position (tokens of the document seen; lower is better)\n\n"
            + table(["run", *labels(edges), "all"], rows) + "\n")


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    fig, ax = subplots(figsize=(5.5, 3.5))
    for label, r in results.items():
        mids = [np.sqrt(lo * (hi - 1)) for lo, hi in zip(r["edges"], r["edges"][1:], strict=False)]
        ax.plot(mids, r["loss"], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens of the document seen (bin's geometric middle)", ylabel="next-token loss (nats)",
           title="validation loss by position")
    ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("position_loss", run, markdown=markdown, plot=plot))

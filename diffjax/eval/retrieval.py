"""Protocol "retrieval": exact multi-needle retrieval accuracy by answer depth (paper §3.4) on the synthetic task."""

from __future__ import annotations

import flax.linen as nn
import numpy as np

from diffjax.config import Config, ConfigError
from diffjax.data.synthetic import DEPTHS, retrieval_examples
from diffjax.eval import Protocol, register
from diffjax.eval.scoring import answer_hits, make_predict, token_accuracy


def retrieval_accuracy(cfg: Config, params, *, n: int = 64, depths: tuple[float, ...] = DEPTHS,
                       seed: int | None = None, batch_size: int | None = None) -> dict:
    """{"by_depth": {depth: accuracy}, "mean": accuracy, "answer_token_accuracy": per-token accuracy} over `n`
    examples per depth, predicted `batch_size` at a time (default: the training batch) under the params' mesh."""
    batch_size = cfg.data.batch_size if batch_size is None else batch_size
    if n < 1 or batch_size < 1:
        raise ConfigError(f"eval.n and eval.batch_size must be positive, got {n} and {batch_size}")
    predict, params = make_predict(cfg, batch_size), nn.meta.unbox(params)
    by_depth, token_acc = {}, []
    for depth in depths:
        batch = retrieval_examples(cfg.data, n, depth=depth, seed=seed)
        preds = predict(params, batch)
        by_depth[float(depth)] = float(np.mean(answer_hits(preds, batch)))
        token_acc.append(token_accuracy(preds, batch))
    return {"by_depth": by_depth, "mean": float(np.mean(list(by_depth.values()))),
            "answer_token_accuracy": float(np.mean(token_acc))}


def applies(cfg: Config) -> bool:
    return cfg.data.source == "synthetic" and "retrieval" in cfg.data.tasks


def markdown(results: dict[str, dict]) -> str:
    depths = list(next(iter(results.values()))["by_depth"])
    lines = ["| run | " + " | ".join(f"depth {float(d):.0%}" for d in depths) + " | mean | answer-token acc. |",
             "|---" * (len(depths) + 3) + "|"]
    for label, r in results.items():
        cells = " | ".join(f"{r['by_depth'][d]:.3f}" for d in depths)
        lines.append(f"| {label} | {cells} | {r['mean']:.3f} | {r['answer_token_accuracy']:.3f} |")
    return "Exact retrieval accuracy by answer depth (paper §3.4)\n\n" + "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    fig, ax = subplots(figsize=(5.5, 3.5))
    for label, r in results.items():
        depths = [float(d) for d in r["by_depth"]]
        ax.plot(depths, list(r["by_depth"].values()), "o-", label=f"{label} (mean {r['mean']:.2f})")
    ax.set(xlabel="answer depth", ylabel="exact retrieval accuracy", ylim=(-0.02, 1.02),
           title="exact retrieval by answer depth (paper §3.4)")
    ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("retrieval", retrieval_accuracy, applies, markdown=markdown, plot=plot))

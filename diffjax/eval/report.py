"""A one-page PNG of a run: the loss curves and, for one retrieval example, every layer's attention map (head
0), with the answer needle's span marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffjax.config import Config
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval.attention_maps import attention_maps
from diffjax.train.metrics import read_metrics


def write_report(workdir: str | Path, cfg: Config, params, *, depth: float = 0.5) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = Path(workdir)
    records = read_metrics(workdir)
    example = retrieval_examples(cfg.data, 1, depth=depth)
    maps = attention_maps(cfg.model, params, example["tokens"], example["positions"], example["segment_ids"])
    n_layers = maps.shape[0]
    fig, axes = plt.subplots(1, n_layers + 1, figsize=(4.2 * (n_layers + 1), 4), squeeze=False)
    ax = axes[0, 0]
    for split, style in (("train", "-"), ("val", "o-")):
        rows = [r for r in records if r.get("split") == split]
        if rows:
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=split, markersize=3)
    ax.set(xlabel="step", ylabel="loss (answer tokens)", title=f"{cfg.name}: loss")
    ax.legend()

    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    query = int(example["answer_start"][0, 0])  # the position whose logits predict the first answer token
    for layer in range(n_layers):
        ax = axes[0, layer + 1]
        m = maps[layer, 0, 0, : query + 1, : query + 1]
        lim = np.percentile(np.abs(m[np.tril_indices_from(m)]), 99.5)  # the first token's sink would hide the rest
        ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.25, label="answer needle")
        ax.set(title=f"layer {layer + 1}, head 1" + (" (A1 − λA2)" if cfg.model.arch == "diff" else ""),
               xlabel="key", ylabel="query")
    axes[0, 1].legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    path = workdir / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

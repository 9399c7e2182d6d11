"""A one-page PNG of a run: the loss curves, the attention of the query that predicts the answer (every layer,
over the keys, the answer needle marked) and every layer's attention map on one retrieval example (mean over
heads, with a colorbar, the query row — the maps' bottom edge — and the needle marked), at most three maps a row;
the retrieval accuracy, what each map is (the arch's `map_label`, e.g. A1 − λA2 + λG for DINT) and, for archs with
one λ per layer, each layer's λ in the titles."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffjax.config import Config
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval.attention_maps import attention_maps
from diffjax.model import archs, layer_lambdas
from diffjax.train.metrics import read_metrics


def write_report(workdir: str | Path, cfg: Config, params, *, depth: float = 0.5,
                 retrieval: dict | None = None) -> Path:
    """`retrieval`: the `retrieval` protocol's result, whose mean accuracy heads the page. Layout: the loss and the
    query's attention over the keys on top, then the layers' maps, at most three a row (four past twelve layers)."""
    from diffjax.plotting import pyplot

    plt = pyplot()

    workdir = Path(workdir)
    example = retrieval_examples(cfg.data, 1, depth=depth)
    maps = np.asarray(attention_maps(cfg.model, params, example["tokens"], example["positions"],
                                     example["segment_ids"]))[:, 0].mean(1)  # [L, T, S]: mean over heads
    lambdas = layer_lambdas(params, cfg.model)
    n_layers, heads = maps.shape[0], cfg.model.n_heads
    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    query = int(example["answer_start"][0, 0])  # the position whose logits predict the first answer token
    kind = archs.get(cfg.model.arch).map_label

    cols = map_columns(n_layers)
    rows = -(-n_layers // cols)
    fig = plt.figure(figsize=(4.6 * cols, 4.4 + 4.0 * rows))
    grid = fig.add_gridspec(1 + rows, 2 * cols, height_ratios=[1.1] + [1] * rows)
    _loss_panel(fig.add_subplot(grid[0, :cols]), read_metrics(workdir))
    ax = fig.add_subplot(grid[0, cols:])
    for layer in range(n_layers):
        ax.plot(np.arange(query + 1), maps[layer, query, : query + 1], lw=1, label=f"layer {layer + 1}")
    ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.35, label="answer needle")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xlabel="key position", ylabel=f"weight ({kind},\nmean over {heads} heads)",
           title=f"attention of the query that predicts the answer\n(position {query}, the maps' bottom row)")
    ax.legend(fontsize=7, ncol=2 if n_layers > 4 else 1)

    for layer in range(n_layers):
        row, col = divmod(layer, cols)
        ax = fig.add_subplot(grid[1 + row, 2 * col: 2 * col + 2])
        m = maps[layer, : query + 1, : query + 1]
        lim = np.percentile(np.abs(m[np.tril_indices_from(m)]), 99.5)  # the first token's sink would hide the rest
        image = ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
        ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.25)
        ax.axhline(query, color="lime", lw=3, label="the query row (the bottom edge)")
        ax.legend(loc="upper right", fontsize=7)
        lam = f", λ = {float(lambdas[layer]):.2f}" if lambdas is not None else ""
        ax.set(title=f"layer {layer + 1}: {kind}{lam}\nmean over {heads} heads", xlabel="key", ylabel="query")

    accuracy = f"retrieval accuracy {retrieval['mean']:.2f} (mean over depths) · " if retrieval else ""
    fig.suptitle(f"{cfg.name} ({cfg.model.arch}) — {accuracy}{n_layers} layers\none retrieval example: the answer "
                 f"needle (gold) at depth {float(example['depth'][0]):.0%} of the context")
    fig.tight_layout()
    path = workdir / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def map_columns(panels: int) -> int:
    """Maps a row: two for up to two (or four) panels, three up to twelve, then four — a page stays readable."""
    return 2 if panels in (1, 2, 4) else 3 if panels <= 12 else 4


def _loss_panel(ax, records: list[dict]) -> None:
    for split, style in (("train", "-"), ("val", "o-")):
        rows = [r for r in records if r.get("split") == split]
        if rows:
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=split, markersize=3)
    ax.set(xlabel="step", ylabel="loss (answer tokens)", yscale="log", title="loss")
    if ax.lines:
        ax.legend()

"""A run's one-page report.png: loss curves, the answer query's attention over the keys (the paper's Figure 1 view)
and every layer's attention map (mean over heads) on one retrieval example, with the needle and query marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffjax import paths
from diffjax.config import Config
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval.attention_maps import answer_row, attention_maps
from diffjax.model import archs, layer_lambdas
from diffjax.train.metrics import read_metrics


def write_report(workdir: str | Path, cfg: Config, params, *, depth: float = 0.5,
                 retrieval: dict | None = None) -> Path:
    """`retrieval`: the `retrieval` protocol's result, whose mean accuracy heads the page."""
    from diffjax.plotting import pyplot, save

    plt = pyplot()

    workdir = paths.run_dir(workdir)
    example = retrieval_examples(cfg.data, 1, depth=depth)
    per_head = np.asarray(attention_maps(cfg.model, params, example["tokens"], example["positions"],
                                         example["segment_ids"]))[:, 0]  # [L, H, T, S]
    maps = per_head.mean(1)  # mean over heads
    lambdas = layer_lambdas(params, cfg.model)
    n_layers, heads = maps.shape[0], cfg.model.n_heads
    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    query = int(example["answer_start"][0, 0])  # the position whose logits predict the first answer token
    kind = archs.get(cfg.model.arch).map_label

    cols = 2 if n_layers in (1, 2, 4) else 3 if n_layers <= 12 else 4  # maps a row: a page stays readable
    rows = -(-n_layers // cols)
    fig = plt.figure(figsize=(4.6 * cols, 4.4 + 4.0 * rows))
    grid = fig.add_gridspec(1 + rows, 2 * cols, height_ratios=[1.1] + [1] * rows)
    _loss_panel(fig.add_subplot(grid[0, :cols]), read_metrics(workdir))
    answer_attention_panel(fig.add_subplot(grid[0, cols:]), {cfg.model.arch: answer_row(per_head, query)[None]},
                           (start, end), query)

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
    path = workdir / "report.png"
    save(fig, path, dpi=100, rect=(0, 0, 1, 0.96))  # room for the two-line suptitle
    return path


def answer_attention_panel(ax, rows: dict[str, np.ndarray], needle: tuple[int, int], query: int) -> None:
    """The paper's Figure 1 view: per label, the mean (± std band) over seeds of `rows[label]` [seeds, query + 1]
    (`attention_maps.answer_attention` of each seed), the needle [start, end) shaded, its share in the legend."""
    start, end = needle
    for label, r in rows.items():
        r = np.atleast_2d(np.asarray(r, np.float64))
        keys, mean = np.arange(r.shape[1]), r.mean(0)
        shares = r[:, start:end].sum(1)
        share = f"{shares.mean():.2f} ± {shares.std(ddof=1):.2f}, n={len(r)}" if len(r) > 1 else f"{shares[0]:.2f}"
        line, = ax.plot(keys, mean, lw=1.2, label=f"{label}: answer-span share {share}")
        if len(r) > 1:
            std = r.std(0, ddof=1)
            ax.fill_between(keys, mean - std, mean + std, color=line.get_color(), alpha=0.25, lw=0)
    ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.35, label="answer needle (the answer span)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xlabel="key position", ylabel="attention a / Σ|a| (signed),\nmean over heads and layers",
           title=f"attention of the query that predicts the answer (position {query}),\n"
                 "the paper's Figure 1 view: answer span vs the rest of the context")
    ax.legend(fontsize=7)


def plain_log_ticks(ax) -> None:
    """Tick labels of a log y axis as plain numbers (0.5, 2, 4.4), not powers of ten (4.4×10⁰)."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda y, _: f"{y:.3g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def _loss_panel(ax, records: list[dict]) -> None:
    for split, style in (("train", "-"), ("val", "o-")):
        rows = [r for r in records if r.get("split") == split]
        if rows:  # a curve of one or two points shows as dots
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], "o-" if len(rows) < 3 else style,
                    label=split, markersize=3)
    ax.set(xlabel="step", ylabel="loss (answer tokens)", yscale="log", title="loss")
    plain_log_ticks(ax)
    if ax.lines:
        ax.legend()


def finish_run(cfg: Config, workdir: Path, result) -> None:
    """The end of `diffjax train` (process 0): retrieval accuracy and report.png, summary.json, a printout."""
    import json

    from diffjax import eval as eval_lib

    out = {"workdir": str(workdir), "step": result.step, "val_loss": (result.val or {}).get("loss")}
    if eval_lib.get("retrieval").applies(cfg):
        print("evaluating retrieval and drawing report.png ...", flush=True)
        out["retrieval_accuracy"] = eval_lib.get("retrieval").run(cfg, result.state.params)
        out["report_png"] = str(write_report(workdir, cfg, result.state.params, retrieval=out["retrieval_accuracy"]))
    (paths.run_dir(workdir) / "summary.json").write_text(json.dumps(out, indent=2))
    print(f"final validation loss: {out['val_loss']:.4f}" if out["val_loss"] is not None else "no validation run")
    if "retrieval_accuracy" in out:
        acc = out["retrieval_accuracy"]
        depths = "  ".join(f"{d:.0%}: {a:.2f}" for d, a in acc["by_depth"].items())
        print(f"retrieval accuracy: {acc['mean']:.3f}  (by answer depth  {depths}); "
              f"answer-token accuracy {acc['answer_token_accuracy']:.3f}")
        print(f"report: {out['report_png']}")
    if result.telemetry_png:
        print(f"telemetry: {result.telemetry_png}")

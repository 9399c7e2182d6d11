"""`telemetry.png` of a run directory, drawn from its metrics.jsonl (`diffjax.train.telemetry` says what each
number is): λ, attention entropy, max |logit|, head-output RMS before / after the head norm, and gradient norms,
one line per layer (colour) over training steps."""

from __future__ import annotations

from pathlib import Path

from diffjax import paths
from diffjax.train.metrics import read_metrics

# (panel title, [(metrics key, line style, label)]); keys a run does not log are left out, empty panels dropped
PANELS = [
    ("λ", [("lambda", "-", "λ")]),
    ("attention entropy [nats]", [("entropy_a", "-", "A"), ("entropy_a1", "-", "A1"), ("entropy_a2", "--", "A2"),
                                  ("entropy_net", ":", "|A1 − λA2|")]),
    ("max |logit|", [("max_logit_a", "-", "A"), ("max_logit_a1", "-", "A1"), ("max_logit_a2", "--", "A2")]),
    ("head output RMS", [("head_rms", "-", "before head norm"), ("head_rms_normed", "--", "after")]),
    ("grad norm: attention", [("grad_norm_attn", "-", "attention")]),
    ("grad norm: MLP", [("grad_norm_mlp", "-", "MLP")]),
]


def _series(records: list[dict], key: str) -> tuple[list[int], list[list[float]]] | None:
    rows = [r for r in records if key in r]
    return ([r["step"] for r in rows], [r[key] for r in rows]) if rows else None


def write(workdir: str | Path) -> Path | None:
    """Draw `workdir/telemetry.png`; None when the run has logged nothing yet."""
    workdir = paths.run_dir(workdir)
    records = [r for r in read_metrics(workdir) if r["split"] in ("train", "telemetry")]
    panels = [(title, [(s, style, label) for key, style, label in lines if (s := _series(records, key))])
              for title, lines in PANELS]
    panels = [(title, lines) for title, lines in panels if lines]
    if not panels:
        return None
    from diffjax.plotting import pyplot

    plt = pyplot()

    n_layers = max(len(values[0]) for _, lines in panels for (_, values), _, _ in lines)
    colors = plt.get_cmap("viridis")([i / max(n_layers - 1, 1) for i in range(n_layers)])
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    fig.subplots_adjust(left=0.05, right=0.9, bottom=0.1, top=0.88, wspace=0.25, hspace=0.5)
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for (steps, values), style, label in lines:
            for layer in range(len(values[0])):
                # a dot where the series has one point (a line of one point draws nothing)
                ax.plot(steps, [v[layer] for v in values], style, color=colors[layer], lw=1.2,
                        marker="o" if len(steps) == 1 else None, ms=4,
                        label=label if layer == 0 and len(lines) > 1 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    sm = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(0, n_layers - 1))
    bar = fig.colorbar(sm, cax=fig.add_axes((0.92, 0.1, 0.012, 0.78)), label="layer (line colour)",
                       ticks=range(n_layers))
    bar.ax.set_yticklabels([str(i + 1) for i in range(n_layers)])  # layers from 1, as report.png numbers them
    fig.suptitle(f"telemetry of {workdir.name}", fontsize=11)
    path = workdir / "telemetry.png"
    paths.save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path

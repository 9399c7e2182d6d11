"""What the notebooks call: tiny demo runs, DIFF's two maps and λ, figures of attention maps and λ over training.

    runs = explore.demo_runs("runs/notebook")          # a tiny DIFF and its Transformer, ~1 CPU minute, resumable
    cfg, params = explore.load(runs["diff"])
    explore.plot_maps(runs, explore.retrieval_example(cfg, depth=0.5), layer=-1, head=0)
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from diffjax import host
from diffjax.config import Config
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval.attention_maps import attention_maps
from diffjax.kernels import reference
from diffjax.model import archs, sown_per_layer
from diffjax.train.loop import train
from diffjax.train.metrics import read_metrics
from diffjax.train.run_loader import load_run

host.cpu_unless_accelerator()  # a notebook on a CPU host: no accelerator plugins probed, no errors in its output


def project_path(path: str | Path) -> Path:
    """`path` relative to the project root (the nearest directory above holding pyproject.toml, else the working
    directory), so a notebook in `notebooks/` names the same runs; absolute paths are kept."""
    path = Path(path)
    if path.is_absolute():
        return path
    here = Path.cwd().resolve()
    root = next((d for d in (here, *here.parents) if (d / "pyproject.toml").is_file()), here)
    return root / path


def demo_config(arch: str, steps: int = 150) -> Config:
    """The main job's model and task (configs/main.py), 1-needle retrieval at length 128, for `steps` steps."""
    from diffjax import sweep as sweep_lib

    member = next(m for m in sweep_lib.load(f"configs/main.py:seeds=1,steps={steps}").members if m.variant == arch)
    return member.config


def demo_runs(workdir: str | Path, steps: int = 150) -> dict[str, Path]:
    """Train (or resume, or just reuse) a tiny DIFF run and its matched Transformer run in `workdir`."""
    runs = {}
    for arch in ("diff", "transformer"):
        runs[arch] = project_path(workdir) / arch
        train(demo_config(arch, steps), runs[arch], progress=False)
    return runs


def load(run_dir: str | Path) -> tuple[Config, dict]:
    """(config, float32 params) of a run directory's latest checkpoint."""
    cfg, params, _ = load_run(project_path(run_dir), params_only=True)
    return cfg, nn.meta.unbox(params)


def retrieval_example(cfg: Config, *, depth: float = 0.5, index: int = 0, seed: int | None = None) -> dict:
    """One retrieval example (a batch of 1) with its answer / needle spans, as the protocols build them."""
    batch = retrieval_examples(cfg.data, index + 1, depth=depth, seed=seed)
    return {k: v[index:index + 1] for k, v in batch.items()}


def diff_components(cfg: Config, params, example: dict) -> dict[str, np.ndarray]:
    """DIFF (V1) only: the two softmax maps A1, A2 [L, H, T, T] (of the arch's logits) and λ [L] of every layer on
    one example."""
    if cfg.model.arch != "diff":
        raise ValueError(f"diff_components needs arch 'diff', got {cfg.model.arch!r}")
    tokens, positions, seg = (jnp.asarray(example[k]) for k in ("tokens", "positions", "segment_ids"))
    b, t = tokens.shape
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=seg)
    out = {"a1": [], "a2": [], "lambda": []}
    logits = archs.get(cfg.model.arch).attention_logits
    for layer in sown_per_layer(cfg.model, params, tokens, positions, seg):
        for name, x in logits(cfg.model, layer["attn"], mask).items():
            out[name].append(reference.softmax(x)[0])
        out["lambda"].append(layer["attn"]["lambda"])
    return {k: np.asarray(jnp.stack(v)) for k, v in out.items()}


def effective_maps(cfg: Config, params, example: dict) -> np.ndarray:
    """Every layer's effective map [L, H, T, T] on one example (A1 − λA2 for DIFF, A for the baseline)."""
    return attention_maps(cfg.model, params, example["tokens"], example["positions"], example["segment_ids"])[:, 0]


def lambda_history(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(steps, λ [steps, layers]) from a DIFF run's metrics.jsonl."""
    rows = [r for r in read_metrics(project_path(run_dir)) if r["split"] == "train" and "lambda" in r]
    by_step = {r["step"]: r["lambda"] for r in rows}  # a resumed run may log a step twice: the last wins
    steps = np.array(sorted(by_step))
    return steps, np.array([by_step[s] for s in steps])


def show_map(ax, m: np.ndarray, example: dict, title: str, *, signed: bool = False) -> None:
    """One [T, T] map up to the first answer query, with its colorbar, the answer needle's keys marked. A signed map
    (A1 − λA2 has negative entries) on a diverging scale centred on 0, a softmax map from 0; the scale ends at the
    99.5th percentile of |entries| (the diagonal's few large ones would wash out the rest), arrows where it clips."""
    query = int(example["answer_start"][0, 0])  # the position whose logits predict the first answer token
    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    m = m[: query + 1, : query + 1]
    lim = max(float(np.percentile(np.abs(m[np.tril_indices_from(m)]), 99.5)), 1e-6)
    low = -lim if signed else 0.0
    image = ax.imshow(m, cmap="RdBu_r" if signed else "Reds", vmin=low, vmax=lim, interpolation="nearest")
    over, under = m.max() > lim, m.min() < low
    extend = "both" if over and under else "max" if over else "min" if under else "neither"
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03, extend=extend)
    ax.axvspan(start - 0.5, end - 0.5, color="gold", alpha=0.3)
    ax.set(title=title, xlabel="key", ylabel="query")


def plot_maps(runs: dict[str, str | Path], example: dict, *, layer: int = -1, head: int = 0):
    """For each run: DIFF → A1, A2 and A1 − λA2; otherwise its effective map (`Arch.map_label`). One row per run;
    returns the figure."""
    import matplotlib.pyplot as plt

    loaded = {name: load(d) for name, d in runs.items()}
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 4.2 * len(runs)), squeeze=False)
    for row, (name, (cfg, params)) in enumerate(loaded.items()):
        maps = effective_maps(cfg, params, example)
        layer_i = layer % cfg.model.n_layers
        if cfg.model.arch == "diff":
            parts = diff_components(cfg, params, example)
            lam = float(parts["lambda"][layer_i])
            panels = [(parts["a1"][layer_i, head], "A1", False), (parts["a2"][layer_i, head], "A2", False),
                      (maps[layer_i, head], f"A1 − λA2 (λ = {lam:.3f})", True)]
        else:
            m = maps[layer_i, head]
            panels = [(m, archs.get(cfg.model.arch).map_label, bool((m < 0).any()))]
        for col in range(3):
            ax = axes[row, col]
            if col < len(panels):
                m, label, signed = panels[col]
                show_map(ax, m, example, f"{name}: layer {layer_i + 1}, head {head + 1}, {label}", signed=signed)
            else:
                ax.axis("off")
    fig.tight_layout()
    return fig

"""What the notebooks call: relative run paths mean the project's, whatever directory the kernel runs in; the maps
a figure shows are the model's."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np

from diffjax import explore
from diffjax.model import DecoderLM


def test_relative_run_paths_resolve_from_the_project_root(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for where in (tmp_path, tmp_path / "notebooks", tmp_path / "notebooks" / "deep"):
        where.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(where)
        assert explore.project_path("runs/main") == tmp_path.resolve() / "runs" / "main"
    assert explore.project_path(tmp_path / "elsewhere") == tmp_path / "elsewhere"  # absolute: kept


def test_writing_a_figure_keeps_the_notebooks_backend(tmp_path):
    """A protocol's plot (Agg, to a file) inside a notebook must not switch its inline backend away: every later
    `plt.show()` would come out blank. A fresh interpreter, whose pyplot already runs on a non-Agg backend."""
    code = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot\n"
            "from diffjax.eval.retrieval import plot\n"
            f"plot({{'diff': {{'by_depth': {{0.0: 0.5, 1.0: 0.75}}, 'mean': 0.625}}}}, r'{tmp_path / 'r.png'}')\n"
            "print(matplotlib.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "svg" and (tmp_path / "r.png").stat().st_size > 0


def test_diff_components_are_the_maps_the_model_combines(rng):
    """A1, A2 and λ as the notebook draws them give the arch's effective map A1 − λA2, and each is a softmax."""
    cfg = explore.demo_config("diff", steps=1)
    example = explore.retrieval_example(cfg, depth=0.5, seed=int(rng.integers(1 << 30)))
    params = nn.meta.unbox(DecoderLM(cfg.model).init(jax.random.key(int(rng.integers(1 << 30))),
                                                     example["tokens"])["params"])
    parts = explore.diff_components(cfg, params, example)
    lam = parts["lambda"][:, None, None, None]  # one λ per layer
    np.testing.assert_allclose(parts["a1"] - lam * parts["a2"], explore.effective_maps(cfg, params, example),
                               atol=1e-6)
    for name in ("a1", "a2"):
        np.testing.assert_allclose(parts[name].sum(-1), 1.0, atol=1e-5)


def test_each_map_has_a_colorbar_and_a_signed_map_a_scale_centred_on_zero(rng):
    """A softmax map's scale starts at 0; A1 − λA2's is symmetric about 0, so its negative entries can be read."""
    import matplotlib.figure

    t = 12
    example = {"answer_start": np.array([[t - 1]]), "needle_start": np.array([3]), "needle_end": np.array([5])}
    a1, a2 = (np.tril(rng.random((t, t))) for _ in range(2))
    a1, a2 = a1 / a1.sum(-1, keepdims=True), a2 / a2.sum(-1, keepdims=True)
    fig = matplotlib.figure.Figure()
    axes = fig.subplots(1, 2)
    explore.show_map(axes[0], a1, example, "A1")
    explore.show_map(axes[1], a1 - 0.8 * a2, example, "A1 − λA2", signed=True)
    (softmax,), (signed,) = axes[0].images, axes[1].images
    assert softmax.colorbar is not None and signed.colorbar is not None
    assert softmax.norm.vmin == 0 < softmax.norm.vmax
    assert signed.norm.vmin == -signed.norm.vmax < 0

"""What the two report.png writers put on the page, read from the figure they save (no training: freshly
initialised parameters): a single run's report (`diffjax.eval.report`) and the main job's (`main_job.write_figure`)
— each map titled by what its arch draws, λ per layer, the main job's retrieval accuracy as its table gives it, the
query row where the legend says it is, and a many-layer report wrapped into rows."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.figure
import matplotlib.image
import pytest

from diffjax import config as config_lib
from diffjax import main_job
from diffjax import sweep as sweep_lib
from diffjax.eval.report import write_report
from diffjax.model import DecoderLM, layer_lambdas


@pytest.fixture
def saved(monkeypatch):
    """The figures saved during the test, as {file name: Figure}."""
    figures = {}
    original = matplotlib.figure.Figure.savefig

    def spy(fig, path, *args, **kwargs):
        figures[str(path).rsplit("/", 1)[-1]] = fig
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return figures


def _params(cfg, seed=0):
    return nn.meta.unbox(DecoderLM(cfg.model).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])


def _lambda_text(params, cfg) -> str:
    return " / ".join(f"{float(x):.2f}" for x in layer_lambdas(params, cfg.model))


def _map_axes(fig):
    return [ax for ax in fig.axes if ax.get_title().startswith("layer ")]


@pytest.mark.parametrize("arch, label", [("dint", "A1 − λA2 + λG"), ("diff", "A1 − λA2"), ("transformer", "A")])
def test_a_single_run_report_labels_each_layer_and_wraps_many_layers_into_rows(tmp_path, saved, arch, label):
    overrides = [f"model.arch={arch}", "model.n_layers=5", "model.d_model=32", "model.n_heads=1",
                 "model.head_dim=16", "data.seq_len=128", "data.n_needles=1"]
    cfg = config_lib.load("configs/quickstart.py", overrides)
    params = _params(cfg)
    path = write_report(tmp_path, cfg, params, retrieval={"mean": 0.375})
    fig = saved["report.png"]
    maps = _map_axes(fig)
    assert len(maps) == 5
    lambdas = layer_lambdas(params, cfg.model)
    for layer, ax in enumerate(maps):
        head = ax.get_title().split("\n")[0]
        lam = f", λ = {float(lambdas[layer]):.2f}" if lambdas is not None else ""
        assert head == f"layer {layer + 1}: {label}{lam}", head  # the arch's own map, not DIFF's for every λ arch
        # the query row is the map's last row, drawn along its bottom edge, where the legend says it is
        (query_line,) = [line for line in ax.get_lines() if line.get_label().startswith("the query row")]
        assert "bottom" in query_line.get_label()
        assert query_line.get_ydata()[0] == ax.get_ylim()[0] - 0.5  # imshow's y axis runs down: ylim[0] is the bottom
    assert "retrieval accuracy 0.38" in fig._suptitle.get_text()
    # five layers: three maps a row, two rows — one page, not a strip
    assert len({round(ax.get_position().x0, 3) for ax in maps}) == 3
    assert len({round(ax.get_position().y0, 3) for ax in maps}) == 2
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width <= 1400 and height > 0.6 * width


def test_the_main_job_figure_titles_each_arch_with_the_tables_accuracy_and_every_layers_lambda(tmp_path, saved):
    sweep = sweep_lib.load("configs/main.py:seeds=2,steps=4,baselines=dint")
    accuracy = {"diff": (0.25, 0.5), "transformer": (0.1, 0.3), "dint": (0.0, 0.6)}
    per_member, shown = {}, {}
    for m in sweep.members:
        run = tmp_path / "members" / m.name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "split": "train", "loss": 3.0 - s / 10})
                                                   + "\n" for s in (1, 2, 3)))
        acc = accuracy[m.variant][m.seed]
        per_member[m.name] = {"arch": m.config.model.arch, "variant": m.variant, "seed": m.seed,
                              "retrieval": {"mean": acc, "by_depth": {"0.5": acc}},
                              "attention_noise": {"answer": [0.1], "noise": [0.2]}, "val_loss": 2.0}
        shown.setdefault(m.variant, (m, m.config, _params(m.config, m.seed)))
    main_job.write_figure(tmp_path, sweep, shown, per_member)
    titles = {ax.get_title().split(":")[0]: ax.get_title() for ax in saved["report.png"].axes if ax.get_title()}

    table = main_job.table(per_member, "transformer")
    header, *rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("|")]
    row = next(cells for cells in rows if cells[0].strip() == "exact retrieval, mean over depths")
    for column, cell in zip(header[1:], row[1:], strict=True):
        if column.strip().endswith("seeds)"):  # an arch's column, not a paired difference
            variant = column.split()[0]
            assert f"{variant}: exact retrieval {cell.strip()} (2 seeds)" in titles[variant], titles[variant]
    for variant, label in (("diff", "A1 − λA2,"), ("dint", "A1 − λA2 + λG,"), ("transformer", "layer: A,")):
        assert label in titles[variant], titles[variant]
    for variant in ("diff", "dint"):
        _, cfg, params = shown[variant]
        assert f"λ by layer = {_lambda_text(params, cfg)}" in titles[variant], titles[variant]
        assert titles[variant].count(" / ") == cfg.model.n_layers - 1
    assert "λ" not in titles["transformer"]

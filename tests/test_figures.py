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
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from diffjax import config as config_lib
from diffjax import main_job
from diffjax import sweep as sweep_lib
from diffjax.eval.attention_maps import answer_attention, attention_maps
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
    init = jax.jit(DecoderLM(cfg.model).init)
    return nn.meta.unbox(init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])


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
    example = main_job.figure_example(sweep)
    accuracy = {"diff": (0.25, 0.5), "transformer": (0.1, 0.3), "dint": (0.0, 0.6)}
    per_member, shown = {}, {}
    for m in sweep.members:
        run = tmp_path / "members" / m.name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "split": "train", "loss": 3.0 - s / 10})
                                                   + "\n" for s in (1, 2, 3)))
        acc = accuracy[m.variant][m.seed]
        per_member[m.name] = {"arch": m.config.model.arch, "variant": m.variant, "seed": m.seed,
                              "retrieval": {"mean": acc, "by_depth": {"0.5": acc}, "answer_token_accuracy": acc},
                              "attention_noise": {"answer": [0.1], "noise": [0.2]}, "val_loss": 2.0,
                              "answer_attention": answer_attention(m.config.model, _params(m.config, m.seed),
                                                                   example).tolist()}
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


def _figure1_axis(fig):
    (ax,) = [ax for ax in fig.axes if "Figure 1" in ax.get_title()]
    return ax


def test_the_main_job_figure_has_the_papers_figure1_panel_with_each_archs_answer_share(tmp_path, saved):
    """Per arch: the answer-predicting query's normalised row, mean over seeds, with a ± std band; the needle
    shaded; the legend's answer-span share equal to the mean over seeds of the row's sum over the needle,
    computed here from the maps themselves (not from the helper the figure uses)."""
    sweep = sweep_lib.load("configs/main.py:seeds=2,steps=4")
    example = main_job.figure_example(sweep)
    start, end = int(example["needle_start"][0]), int(example["needle_end"][0])
    query = int(example["answer_start"][0, 0])
    per_member, shown, rows = {}, {}, {}
    for m in sweep.members:
        run = tmp_path / "members" / m.name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 3.0}) + "\n")
        params = _params(m.config, 100 + m.seed)
        if m.variant == "diff":  # λ near 1 (λ_q1·λ_k1 = 0.5), so A1 − λA2 has negative entries
            params = jax.tree_util.tree_map_with_path(
                lambda path, x: jnp.full_like(x, (0.5 / x.size) ** 0.5) if "lambda_" in jax.tree_util.keystr(path)
                and jax.tree_util.keystr(path).endswith("1']") else x, params)
        maps = np.asarray(attention_maps(m.config.model, params, example["tokens"], example["positions"],
                                         example["segment_ids"]))[:, 0, :, query, : query + 1]  # [L, H, S]
        if m.variant == "diff":
            assert (maps < 0).any()  # so a share normalised by the row sum instead of Σ|a| would differ
        row = np.mean([[h / np.abs(h).sum() for h in layer] for layer in maps], axis=(0, 1))
        rows.setdefault(m.variant, []).append(row)
        per_member[m.name] = {"arch": m.config.model.arch, "variant": m.variant, "seed": m.seed,
                              "retrieval": {"mean": 0.5, "by_depth": {"0.5": 0.5}},
                              "attention_noise": {"answer": [0.1], "noise": [0.2]}, "val_loss": 2.0,
                              "answer_attention": answer_attention(m.config.model, params, example).tolist()}
        shown.setdefault(m.variant, (m, m.config, params))
    main_job.write_figure(tmp_path, sweep, shown, per_member)
    ax = _figure1_axis(saved["report.png"])
    lines = {line.get_label().split(":")[0]: line for line in ax.get_lines() if "answer-span share" in
             line.get_label()}
    assert set(lines) == {"diff", "transformer"}
    for variant, line in lines.items():
        expected = np.array(rows[variant])
        np.testing.assert_allclose(line.get_ydata(), expected.mean(0), atol=1e-6)
        shares = expected[:, start:end].sum(1)
        assert f"answer-span share {shares.mean():.2f} ± {shares.std(ddof=1):.2f}, n=2" in line.get_label()
    assert len(ax.collections) >= 2  # a ± std band per arch
    (span,) = [p for p in ax.patches if p.get_label().startswith("answer needle")]
    x0, x1 = span.get_x(), span.get_x() + span.get_width()
    assert (x0, x1) == (start - 0.5, end - 0.5)


def test_a_single_run_report_has_the_figure1_panel(tmp_path, saved):
    cfg = config_lib.load("configs/quickstart.py", ["model.n_layers=2", "data.seq_len=128", "data.n_needles=1"])
    params = _params(cfg, 3)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "split": "val", "loss": 2.5}) + "\n")
    write_report(tmp_path, cfg, params)
    fig = saved["report.png"]
    ax = _figure1_axis(fig)
    (line,) = [line for line in ax.get_lines() if "answer-span share" in line.get_label()]
    assert line.get_label().startswith(f"{cfg.model.arch}: answer-span share ")
    loss_ax = next(a for a in fig.axes if a.get_title() == "loss")
    (val,) = loss_ax.get_lines()
    assert val.get_marker() == "o"  # a one-point curve is drawn as a dot, not an invisible line
    FigureCanvasAgg(fig).draw()
    labels = [t.get_text() for t in loss_ax.get_yticklabels(which="both") if t.get_text()]
    assert labels and not any("times" in t or "^" in t for t in labels), labels


def test_protocol_figures_say_what_they_show(tmp_path, saved, rng):
    """attention_noise: y axes from 0 (not a sliver around the data), layers numbered from 1 as in report.png;
    needle: a colorbar and the metric in the title; retrieval: a title; each legend names the run it was given."""
    from diffjax import eval as eval_lib

    label = "myrun (diff, step 40)"
    depths = [0.0, 0.5, 1.0]
    shares = {k: [[float(x) for x in rng.uniform(0.13, 0.15, 2)] for _ in depths]
              for k in ("answer", "noise", "question", "negative", "row_sum")}
    noise = {"depths": depths, "answer": [0.14, 0.15, 0.145], "noise": [0.2, 0.21, 0.2], "per_layer": shares}
    eval_lib.get("attention_noise").plot({label: noise}, tmp_path / "a.png")
    fig = saved["a.png"]
    for ax in fig.axes[:2]:
        assert ax.get_ylim()[0] <= 0 and ax.get_ylim()[1] >= 0.5
    (answer_line, _) = fig.axes[2].get_lines()[:2]
    assert list(answer_line.get_xdata()) == [1, 2]
    assert label in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]

    heatmap = {"lengths": [64, 128], "accuracy": [[0.5, 1.0], [0.25, None], [0.0, 0.75]], "mean": [0.25, 0.875],
               "n_needles": 2, "n_query_cities": 1}
    eval_lib.get("needle").plot({label: {"depths": depths, "heatmap": heatmap}}, tmp_path / "n.png")
    fig = saved["n.png"]
    assert any(ax.get_ylabel() == "exact retrieval accuracy" for ax in fig.axes)  # the colorbar
    assert fig.axes[0].get_title().startswith(label) and "exact retrieval accuracy" in fig.axes[0].get_title()

    eval_lib.get("retrieval").plot({label: {"by_depth": {0.0: 0.5, 1.0: 0.25}, "mean": 0.375}}, tmp_path / "r.png")
    ax = saved["r.png"].axes[0]
    assert ax.get_title() and label in ax.get_legend().get_texts()[0].get_text()


def test_telemetry_draws_a_single_logged_point_and_numbers_layers_from_1(tmp_path, saved, rng):
    """A run with one telemetry record still shows each layer's value (a dot), at the value logged; the colorbar
    numbers layers 1..L as report.png does."""
    from diffjax.train import telemetry_plot

    lam = rng.uniform(0.1, 0.9, 3).round(4).tolist()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7, "split": "telemetry", "lambda": lam}) + "\n")
    telemetry_plot.write(tmp_path)
    fig = saved["telemetry.png"]
    panel = next(ax for ax in fig.axes if ax.get_title() == "λ")
    points = [(line.get_xdata().tolist(), line.get_ydata().tolist(), line.get_marker()) for line in panel.lines]
    assert [(x, y) for x, y, _ in points] == [([7], [v]) for v in lam]
    assert all(marker not in (None, "None", "") for _, _, marker in points)
    bar = fig.axes[-1]
    assert [t.get_text() for t in bar.get_yticklabels()] == ["1", "2", "3"]

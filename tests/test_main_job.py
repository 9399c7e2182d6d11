"""The main job (`diffjax train` with no --config) end to end at a few steps: both archs, several seeds, the
side-by-side table with its rows, the report PNG and summary.json."""

import json

import matplotlib.image
import numpy as np
import pytest

from diffjax import cli, main_job


@pytest.mark.slow
@pytest.mark.optimized
def test_main_job_end_to_end(tmp_path, capsys):
    args = ["train", "--config", "configs/main.py:seeds=2,steps=40", "--workdir", str(tmp_path), "--no-progress",
            "--set", "train.eval_batches=1", "--set", "train.steps=4"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "retrieval at length 128, 4 steps" in printed  # the steps the members train, --set applied
    assert "main job (configs/main.py:seeds=2,steps=40: a sweep of 4 runs)" in printed  # what it is, said
    header = next(line for line in printed.splitlines() if line.startswith("| metric"))
    assert "diff (2 seeds)" in header and "transformer (2 seeds)" in header and "diff − transformer, paired" in header
    for row in ("exact retrieval, mean over depths", "answer at depth 50%",
                "answer tokens right (per token, all depths)", "attention on the answer span",
                "attention on the rest of the context (noise)", "final validation loss"):
        line = next(line for line in printed.splitlines() if line.startswith("|") and line.split("|")[1].strip() == row)
        assert len(line.split("|")) == 6 and "±" in line and "p=" in line, line  # metric, diff, transformer, paired
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["table"] in (tmp_path / "summary.md").read_text() and summary["table"] in printed
    members = summary["members"]
    assert sorted(members) == ["diff__seed0", "diff__seed1", "transformer__seed0", "transformer__seed1"]
    for m in members.values():
        assert 0 <= m["retrieval"]["mean"] <= 1 and np.isfinite(m["val_loss"])
    # the printed rows, recomputed from the members' own numbers: mean ± std per arch, and DIFF − Transformer
    # paired by seed
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in printed.splitlines() if line.startswith("| ") and "±" in line}
    for label, get in [("final validation loss", lambda m: m["val_loss"]),
                       ("attention on the answer span", lambda m: np.mean(m["attention_noise"]["answer"])),
                       ("exact retrieval, mean over depths", lambda m: m["retrieval"]["mean"]),
                       ("answer tokens right (per token, all depths)",
                        lambda m: m["retrieval"]["answer_token_accuracy"])]:
        values = {arch: [get(members[f"{arch}__seed{s}"]) for s in (0, 1)] for arch in ("diff", "transformer")}
        for column, arch in enumerate(("diff", "transformer")):
            assert rows[label][column] == f"{np.mean(values[arch]):.3f} ± {np.std(values[arch], ddof=1):.3f}"
        differences = np.subtract(values["diff"], values["transformer"])
        assert rows[label][2].startswith(f"{differences.mean():+.3f} ["), (label, rows[label][2])
        # under the table, the plain reading with each seed's own difference
        reading = next(line for line in printed.splitlines() if line.startswith(f"- diff − transformer in {label}:"))
        assert f"per seed {differences[0]:+.4f}, {differences[1]:+.4f};" in reading, reading
        assert reading.endswith("n = 2): too few seeds to judge at n = 2"), reading  # whatever p, at two seeds
    image = matplotlib.image.imread(tmp_path / "report.png")
    assert image.shape[0] > 0.8 * image.shape[1]  # 2 × 2: loss, Figure 1 view, one attention map per arch
    for m in members.values():  # the Figure 1 row of every member: over the keys up to the query, Σ|a| = 1
        assert abs(np.abs(m["answer_attention"]).sum() - 1) < 1e-5
    # the README's check reads a fresh summary: it agrees with itself and flags a moved cell
    table = (tmp_path / "summary.md").read_text()
    assert main_job.disagreements(table, table) == []
    diff_cell = next(line for line in table.splitlines() if line.startswith("| final validation loss")).split("|")[2]
    mean, std = (float(x) for x in diff_cell.split("±"))
    moved = table.replace(diff_cell, f" {mean + std + 0.002:.3f} ± {std:.3f} ")
    assert [d.split(":")[0] for d in main_job.disagreements(table, moved)] == ["final validation loss / diff"]
    # a finished job, rerun, resumes and reprints without training again
    assert cli.main(args) == 0
    assert "| metric" in capsys.readouterr().out

"""Progress a person can read: the terminal bar fits 80 columns with a sweep's label, and where output goes to a log
(nohup, SLURM) one plain line every `every` seconds with the step, loss, tokens/s and an ETA from the measured rate."""

import io

from rich.console import Console

from diffjax.train import progress
from diffjax.train.progress import ProgressBar


def test_the_bar_fits_80_columns_with_a_sweep_label():
    console = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    bar = ProgressBar.bar("group 12 (16× serial)", console=console)
    info = ProgressBar.info({"loss": 1.2345, "lr": 1e-3, "tokens_per_s": 123456.0})
    bar.add_task("", total=24000, completed=12000, info=info)
    console.print(bar.get_renderable())
    (line,) = [line for line in console.file.getvalue().splitlines() if line.strip()]
    assert len(line) <= 80
    for part in ("group 12 (16× serial)", "12000/24000", "-:--:--", "loss 1.2345 123,456 tok/s"):
        assert part in line, (part, line)  # nothing cut


def test_a_log_gets_a_plain_line_every_interval_with_an_eta_from_the_rate(monkeypatch, capsys):
    clock = iter([100.0, 110.0, 115.0, 190.0])  # enter, then three updates
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    metrics = {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 4096.0}
    with ProgressBar(total=100, start=20, enabled=True, every=30.0) as bar:  # stdout captured: not a terminal
        bar.update(30, metrics)  # 10 steps in 10 s: 70 steps left, 70 s
        bar.update(35, metrics)  # 5 s later: within the interval, no line
        bar.update(100, metrics)  # the last step always prints
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0] == "train: step 30/100 (30%)  loss 2.5000 4,096 tok/s  lr 1.0e-03  eta 0:01:10"
    assert lines[1].startswith("train: step 100/100 (100%)") and lines[1].endswith("eta 0:00:00")


def test_a_disabled_bar_prints_nothing(capsys):
    with ProgressBar(total=10, start=0, enabled=False) as bar:
        bar.update(10, {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        bar.note("evaluating")
    assert capsys.readouterr().out == ""

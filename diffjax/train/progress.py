"""The training progress line: a rich bar on a terminal, plain lines in a log."""

from __future__ import annotations

import datetime
import math
import sys
import time


class ProgressBar:
    """Progress with the latest loss: a rich bar on a terminal; where output goes to a log (nohup, SLURM), one
    plain line every `every` seconds and at the end. Silent when disabled (tests, non-main processes)."""

    def __init__(self, total: int, start: int, enabled: bool, label: str = "train", every: float = 30.0):
        self.enabled, self.total, self.start, self.label = enabled, total, start, label
        self.every, self.terminal = every, sys.stdout.isatty()

    @staticmethod
    def bar(label: str, console=None):
        """The terminal bar: label, bar, steps done / total, ETA, latest loss and tokens/s — one line that fits 80
        columns with a label of up to ~20 characters (a sweep's "group 1 (3× serial)")."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # a long speed window: logged steps can be minutes apart on a CPU, and the ETA needs two of them
        return Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=12), MofNCompleteColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), speed_estimate_period=3600,
                        console=console)

    @staticmethod
    def info(metrics: dict) -> str:
        return f"loss {metrics['loss']:.4f} {metrics['tokens_per_s']:,.0f} tok/s"

    def __enter__(self):
        if self.enabled and self.terminal:
            self.progress = self.bar(self.label)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=self.total, completed=self.start, info="")
        self.clock = (time.monotonic(), self.start)
        self.printed = -math.inf
        return self

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        info = self.info(metrics)
        if self.terminal:
            self.progress.update(self.task, completed=step, info=info)
            return
        now = time.monotonic()
        if now - self.printed >= self.every or step == self.total:
            self.printed = now
            started, first = self.clock
            rate = (step - first) / max(now - started, 1e-9)
            eta = datetime.timedelta(seconds=round((self.total - step) / rate)) if rate > 0 else "?"
            print(f"{self.label}: step {step}/{self.total} ({step / self.total:.0%})  {info}  lr {metrics['lr']:.1e}  "
                  f"eta {eta}", flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            if self.terminal:
                self.progress.console.log(text)
            else:
                print(f"{self.label}: {text}", flush=True)

    def __exit__(self, *exc):
        if self.enabled and self.terminal:
            self.progress.stop()
        return False

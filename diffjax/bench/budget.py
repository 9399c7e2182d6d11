"""Time limits of the device check: one budget for the run, split over its sections in order of value. A section
works in units (a length, a pair of models, a case) and starts one only while its deadline leaves as much time as
the last took (`Units`); where it stops, it is reported as cut short, with what it did measure."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator


class Deadline:
    """The end of a section on `clock` (seconds)."""

    def __init__(self, end: float, clock: Callable[[], float]):
        self.end, self.clock = end, clock

    def left(self) -> float:
        return self.end - self.clock()

    def allows(self, estimate_s: float = 0.0) -> bool:
        """Whether work taking about `estimate_s` ends before the deadline (never once it has passed)."""
        return self.left() > max(estimate_s, 0.0)


class Budget:
    """`total_s` seconds from now on `clock`, shared by the named sections in proportion to their `shares`."""

    def __init__(self, total_s: float, shares: dict[str, float], clock: Callable[[], float] = time.monotonic):
        self.clock, self.shares = clock, dict(shares)
        self.end = clock() + total_s

    def section(self, name: str) -> Deadline:
        """The deadline of section `name`, starting now: its share of the time left among itself and those after it."""
        names = list(self.shares)
        rest = sum(self.shares[n] for n in names[names.index(name):])
        left = max(0.0, self.end - self.clock())
        return Deadline(self.clock() + left * self.shares[name] / rest, self.clock)


class Units:
    """Iterates `items` while `deadline` allows the next, estimated to take as long as the one before (the first
    `first_estimate_s`); then `cut` says where it stopped (None when every unit ran)."""

    def __init__(self, items: Iterable, deadline: Deadline, first_estimate_s: float = 0.0, name=str):
        self.items, self.deadline, self.estimate, self.name = list(items), deadline, first_estimate_s, name
        self.cut: dict | None = None

    def __iter__(self) -> Iterator:
        clock = self.deadline.clock
        for done, item in enumerate(self.items):
            if not self.deadline.allows(self.estimate):
                self.cut = dict(done=done, of=len(self.items), next=self.name(item),
                                left_s=max(0.0, self.deadline.left()), needed_s=self.estimate)
                return
            start = clock()
            yield item
            self.estimate = clock() - start


def describe_cut(cut: dict) -> str:
    """One line: what a cut section left undone and why."""
    return (f"Cut short by the time budget: {cut['done']} of {cut['of']} units done; the next ({cut['next']}) needed "
            f"~{cut['needed_s']:.0f} s, {cut['left_s']:.0f} s were left")

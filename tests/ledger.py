"""The suite's time ledger: where each test's seconds go.

As a pytest plugin (`--ledger FILE`; conftest calls `add_option` and `configure`; `make test` writes
`.cache/ledger/*.json`): for every test its seconds (setup + call + teardown, on the worker that ran it), the seconds
JAX spent in XLA's backend compile (`/jax/core/compile/backend_compile_duration`: compiling, or reading the
persistent cache on a hit), the programs it compiled and read from the cache, its tracing and lowering seconds, and
the processes it started (`subprocess`, `multiprocessing`; their own compiles are inside the test's seconds, not its
compile seconds). A session-scoped fixture's cost lands on the first test that asks for it.

As a script, the tables docs/testing.md shows:

    python tests/ledger.py .cache/ledger/main.json [--before OLD.json] [--modules 15] [--top 25]
"""

import argparse
import json
import multiprocessing.process
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
FIELDS = ("compile_s", "programs", "cache_hits", "trace_s", "processes")


def add_option(parser):
    parser.addoption("--ledger", metavar="FILE",
                     help="write the time ledger (each test's seconds, compile seconds, programs and processes) to "
                          "FILE; `python tests/ledger.py FILE` prints its tables (docs/testing.md)")


def configure(config):
    if config.getoption("ledger"):
        config.pluginmanager.register(Ledger(config.getoption("ledger")), "ledger")


class _Counters:
    """Running totals in this process; a report takes what accrued since the previous one."""

    def __init__(self):
        self.totals = dict.fromkeys(FIELDS, 0.0)
        self.taken = dict(self.totals)

    def add(self, field, amount=1.0):
        self.totals[field] += amount

    def take(self):
        delta = {k: self.totals[k] - self.taken[k] for k in FIELDS}
        self.taken = dict(self.totals)
        return delta


class Ledger:
    def __init__(self, path):
        self.path = Path(path)
        self.counters = _Counters()
        self.rows = defaultdict(lambda: {"seconds": 0.0, **dict.fromkeys(FIELDS, 0.0)})
        self.start = time.time()
        self._listen()

    def _listen(self):
        import jax.monitoring

        def on_duration(event, seconds, **_):
            if event == COMPILE_EVENT:
                self.counters.add("compile_s", seconds)
                self.counters.add("programs")
            elif event in TRACE_EVENTS:
                self.counters.add("trace_s", seconds)

        def on_event(event, **_):
            if event == CACHE_HIT_EVENT:
                self.counters.add("cache_hits")

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        counters = self.counters
        for cls, method in ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")):
            original = getattr(cls, method)

            def counted(*args, _original=original, **kwargs):
                counters.add("processes")
                return _original(*args, **kwargs)

            setattr(cls, method, counted)

    # On each worker (or the only process): attach what accrued to the phase's report, which xdist carries over.
    def pytest_runtest_logstart(self, nodeid, location):
        self.counters.take()  # what ran between tests belongs to none

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        outcome.get_result().user_properties.append(("ledger", self.counters.take()))

    # Where the reports arrive (the controller under xdist): sum the phases per test, write the file at the end.
    def pytest_runtest_logreport(self, report):
        row = self.rows[report.nodeid]
        row["seconds"] += report.duration
        for key, value in report.user_properties:
            if key == "ledger":
                for field in FIELDS:
                    row[field] += value[field]
        if report.when == "call" or report.outcome != "passed":
            row["outcome"] = report.outcome
        worker = getattr(getattr(report, "node", None), "gateway", None)
        row["worker"] = worker.id if worker else "main"

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.start))
        workers = len({row["worker"] for row in self.rows.values()})
        self.path.write_text(json.dumps({
            "wall_s": time.time() - self.start, "started": started, "python": sys.version.split()[0],
            "jax": _jax_version(), "workers": workers, "tests": dict(self.rows)}, indent=1))

    def pytest_terminal_summary(self, terminalreporter):
        if self.rows:
            terminalreporter.write_line(f"time ledger: {self.path} (tables: python tests/ledger.py {self.path})")


def _jax_version():
    import jax

    return jax.__version__


# The report.

def module_of(nodeid):
    return nodeid.split("::")[0]


def by_module(tests):
    modules = defaultdict(lambda: {"seconds": 0.0, "tests": 0, **dict.fromkeys(FIELDS, 0.0)})
    for nodeid, row in tests.items():
        m = modules[module_of(nodeid)]
        m["tests"] += 1
        for field in ("seconds", *FIELDS):
            m[field] += row[field]
    return modules


def table(rows, before, first_column, count_column):
    """A markdown table; with `before`, each row's seconds and programs then, in brackets."""
    head = f"| {first_column} | s | compile s | programs | from cache | trace s | processes |"
    lines = [head if count_column is None else head.replace(" | s |", f" | {count_column} | s |")]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for name, r in rows:
        then = before.get(name)
        seconds, programs = (f"{r[k]:.0f}" + (f" ({then[k]:.0f})" if then else "") for k in ("seconds", "programs"))
        cells = [f"`{name}`"] + ([str(r["tests"])] if count_column else []) + [
            seconds, f"{r['compile_s']:.0f}", programs, f"{r['cache_hits']:.0f}", f"{r['trace_s']:.0f}",
            f"{r['processes']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--before", type=Path, help="an earlier ledger: its seconds and programs in brackets")
    parser.add_argument("--modules", type=int, help="how many of the slowest modules to list (default: all)")
    parser.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    now = json.loads(args.ledger.read_text())
    then = json.loads(args.before.read_text()) if args.before else {"tests": {}}
    tests = now["tests"]
    modules = by_module(tests)
    total = {f: sum(m[f] for m in modules.values()) for f in ("seconds", "tests", *FIELDS)}
    print(f"{args.ledger}: {now['started']} UTC, Python {now['python']}, jax {now['jax']}, "
          f"{now['workers']} worker(s), {now['wall_s']:.0f} s wall; {total['tests']:.0f} tests, "
          f"{total['seconds']:.0f} worker-seconds, {total['compile_s']:.0f} compiling "
          f"({total['programs']:.0f} programs, {total['cache_hits']:.0f} of them read from the cache), "
          f"{total['trace_s']:.0f} tracing and lowering, {total['processes']:.0f} processes started"
          + (f" (before: {sum(r['seconds'] for r in then['tests'].values()):.0f} worker-seconds, "
             f"{sum(r['programs'] for r in then['tests'].values()):.0f} programs, {then['wall_s']:.0f} s wall)"
             if args.before else "") + "\n")
    ordered = sorted(modules.items(), key=lambda kv: -kv[1]["seconds"])[:args.modules]
    print(table(ordered, by_module(then["tests"]), "module", "tests"), end="\n\n")
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:args.top]
    print(table(slowest, then["tests"], "test", None))


if __name__ == "__main__":
    main()

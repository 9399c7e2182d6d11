"""The time ledger (tests/ledger.py) counts what each test compiled and started, and its report sums them."""

import json

import ledger

pytest_plugins = ["pytester"]

INNER = '''
import subprocess, sys

import jax, numpy as np


def test_compiles_two_programs():
    jax.jit(lambda x: x + 1)(np.ones(3))
    jax.jit(lambda x: x * 2)(np.ones(5))


def test_starts_two_processes():
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_the_ledger_counts_each_tests_programs_and_processes(pytester, capsys):
    pytester.makeconftest("import ledger\n\n\ndef pytest_addoption(parser):\n    ledger.add_option(parser)\n\n\n"
                          "def pytest_configure(config):\n    ledger.configure(config)\n")
    pytester.makepyfile(test_inner=INNER)
    path = pytester.path / "ledger.json"
    pytester.runpytest_inprocess("--ledger", str(path), "-p", "no:cacheprovider").assert_outcomes(passed=2)
    tests = json.loads(path.read_text())["tests"]
    programs, processes = (tests[f"test_inner.py::{name}"] for name in ("test_compiles_two_programs",
                                                                         "test_starts_two_processes"))
    assert programs["programs"] == 2 and programs["compile_s"] > 0 and programs["processes"] == 0
    assert processes["processes"] == 2 and processes["programs"] == 0
    assert all(row["outcome"] == "passed" and row["seconds"] > 0 for row in tests.values())
    capsys.readouterr()
    ledger.main([str(path), "--before", str(path)])
    report = capsys.readouterr().out
    assert "2 tests," in report and "2 programs" in report and "2 processes started" in report
    assert "| `test_inner.py` | 2 |" in report

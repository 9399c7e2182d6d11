"""The CLI's help: fast (no jax imported), every option described, the shipped configs and the protocols listed."""

import argparse
import subprocess
import sys

from helpers import REPO, cli_env

from diffjax import cli
from diffjax import eval as eval_lib


def test_help_imports_no_jax():
    code = "import sys\nfrom diffjax import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n" \
           "print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-500:] + out.stderr[-500:]


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_says_what_it_does_and_the_lists_are_complete():
    parser = cli.build_parser()
    undocumented = [(p.prog, a.dest) for p in _parsers(parser) for a in p._actions
                    if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert undocumented == []
    listed = parser.epilog.split("evaluation protocols: ")[1].split(" (docs")[0].replace(" (the default)", "")
    assert sorted(listed.split(", ")) == sorted(eval_lib.names())
    assert "configs/main.py" in parser.epilog and "sweep" in parser.description.splitlines()[0]

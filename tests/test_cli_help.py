"""The CLI's help: fast (no jax imported), every option described, the shipped configs and the protocols listed."""

import argparse
import importlib
import pkgutil
import subprocess
import sys

from helpers import REPO, cli_env

from diffjax import cli
from diffjax import eval as eval_lib


def test_help_imports_no_jax():
    code = "import sys\nfrom diffjax import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n" \
           "print('jax' in sys.modules)"
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
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
    listed = parser.epilog.split("evaluation protocols: ")[1].split(" (docs")[0]
    assert sorted(listed.split(", ")) == sorted(eval_lib.names())
    assert "configs/main.py" in parser.epilog and "sweep" in parser.description.splitlines()[0]


def test_the_protocols_help_lists_are_the_registered_ones():
    """`eval.PROTOCOLS`, which `--help` reads without importing a protocol, names exactly what diffjax/eval's modules
    register (each module imported), in `names()`' order; `diffjax eval --help` gives each with what it measures."""
    for module in pkgutil.iter_modules(eval_lib.__path__):
        importlib.import_module(f"diffjax.eval.{module.name}")
    assert set(eval_lib._REGISTRY) == set(eval_lib.PROTOCOLS)
    assert eval_lib.names() == tuple(eval_lib.PROTOCOLS)
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    listed = commands["eval"].format_help().split("evaluation protocols")[1].splitlines()[1:]
    assert [line.split(None, 1) for line in listed] == [[name, what] for name, what in eval_lib.PROTOCOLS.items()]


def test_scripts_and_notebooks_start_jax_without_plugin_lines():
    """As a user's shell and a notebook's kernel run them (fresh processes, JAX_PLATFORMS unset, the compile extra's
    CUDA plugin installed, no GPU): an experiments script and a notebook's imports print nothing on stderr — not the
    plugin's "Could not find cuda drivers", printed from C++ when jax is imported and when its backends start."""
    env = {k: v for k, v in cli_env().items() if k != "JAX_PLATFORMS"}
    script = subprocess.run([sys.executable, "experiments/ablation.py", "--help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 0 and "--seeds" in script.stdout and script.stderr == "", script.stderr
    notebook = "from diffjax import eval, explore\nimport jax\nprint(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", notebook], cwd=REPO / "notebooks", env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip() == "cpu" and out.stderr == "", out.stderr

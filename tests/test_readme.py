"""Every recipe runs as written: the commands are read from the indented code blocks of README.md and of the docs
pages that hold recipes (`RECIPE_FILES`, in that order); each is either run — from a fresh directory outside the
checkout, in that order, shortened only by appended `--set`s — or skipped for a stated reason; a command that this
file does not classify fails the test, so a new recipe cannot go untested by accident. The first runs as the user's
`diffjax` process; the rest through `cli.main` in this one (the entry point is the same; its start-up is paid once)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, cli_env

from diffjax import cli

# the files with recipes, in the order their commands run (a later page's recipe may use an earlier one's run)
RECIPE_FILES = [REPO / name for name in ("README.md", "docs/training.md", "docs/sweeps.md", "docs/compile.md",
                                         "docs/hf.md", "docs/multihost.md", "docs/data.md", "docs/testing.md")]
# appended to every train / sweep: a few steps of a one-layer, 64-wide model on 256-token batches of 8, one per fake
# device in process (the path each recipe takes is the same at any size; the README's sizes cost minutes here)
SHORT = ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=4", "train.eval_batches=1",
         "train.log_every=2", "model.n_layers=1", "model.d_model=64", "data.seq_len=256", "data.batch_size=8"]
# and to the own-data recipe, whose text has no needles to fit: 64-token batches and a 32-wide model (its 100k-token
# vocabulary's embedding and head cost the most)
SHORT_OWN_DATA = ["data.seq_len=64", "model.d_model=32"]
# (the command up to a space or its end, None to run it, else why it is not run here)
CLASSIFIED = [
    # a run on a bucket: tests/test_object_storage.py runs these against fake-gcs-server
    ("diffjax eval --workdir gs://my-bucket/runs/diff-1.4b", "a bucket: test_object_storage.py, a fake one"),
    ("diffjax generate --workdir gs://my-bucket/runs/diff-1.4b", "a bucket: test_object_storage.py, a fake one"),
    ("diffjax hf export --workdir gs://my-bucket/runs/diff-1.4b", "a bucket: test_object_storage.py, a fake one"),
    ("diffjax lm-eval --workdir gs://my-bucket/runs/diff-1.4b", "a bucket, and downloads the tasks' datasets"),
    ("diffjax sweep --config configs/sweep_demo.py --workdir gs://my-bucket/sweeps/demo",
     "a bucket: test_object_storage.py sweeps into a fake one"),
    ("make train", "the main job (`diffjax train` with no config): tests/test_packaging.py runs it from a wheel"),
    ("make test", "this test suite"),
    ("make test-fast", "a subset of this test suite"),
    ("make gpu-preflight", "a venv with the GPU machine's jax, then ~12 min of compiles; test_device_check compiles "
     "the same programs with this venv's jax"),
    ("diffjax train --config configs/small.py:size=small,arch=diff", None),
    ("diffjax train --config configs/small.py:size=small,arch=transformer", None),
    ("diffjax eval --workdir runs/s-diff", None),
    ("diffjax summary", None),
    ("diffjax sweep --config configs/sweep_demo.py", None),
    ("diffjax sweep --config configs/sweep_demo.py:seeds=5", "the command above with more seeds and steps"),
    ("diffjax sweep --report runs/sweeps/sweep_demo", None),
    ("diffjax compile", "a 1.4B compile for a TPU slice takes minutes; tests/test_aot.py compiles for the targets"),
    ("diffjax hf export --workdir runs/llama", "the walkthrough above"),
    ("diffjax hf export", None),
    ("diffjax hf import hf/llama --as diff", "needs a Llama checkpoint: tests/test_llama_to_diff.py converts one"),
    ("diffjax train --workdir runs/z", "trains that conversion: tests/test_llama_to_diff.py"),
    ("diffjax hf import ~/models/llama",
     "needs a pretrained checkpoint: tests/test_llama_to_diff.py runs the walkthrough on one it makes"),
    ("diffjax eval --workdir runs/llama", "the walkthrough above"),
    ("diffjax eval --workdir runs/llama-diff", "the walkthrough above"),
    ("diffjax train --workdir runs/llama-diff", "the walkthrough above"),
    ("diffjax generate --workdir runs/llama-diff", "the walkthrough above"),
    ("diffjax train --workdir runs/llama", "the walkthrough above"),
    ("diffjax hf import", None),
    ("diffjax generate --workdir runs/x --prompt", None),
    ("diffjax generate --workdir runs/x --prompts", "needs the user's prompts file; tests/test_generate.py"),
    ("diffjax lm-eval --workdir runs/x --tasks arc_easy,piqa", "downloads the tasks' datasets"),
    ("diffjax lm-eval --workdir runs/x --tasks my_task", "needs the user's task YAMLs; tests/test_lm_harness.py"),
    ("diffjax train --config configs/quickstart.py --workdir runs/mp", "two processes: tests/test_multiprocess.py"),
    ("diffjax train --config configs/paper.py:size=1.4B,arch=diff", "a multi-host 1.4B run"),
    ("diffjax prepare --source text --path corpus.txt", "the Llama → DIFF walkthrough (docs/hf.md)"),
    ("diffjax prepare --path fineweb-edu/sample/10BT", "a Hugging Face download (docs/data.md): "
     "tests/test_prepare_sources.py prepares a directory of Parquet files"),
    ("diffjax prepare --source text", None),
    ("diffjax train --config configs/quickstart.py --set data.source=shards", None),
]
# the README's placeholders, as this test fills them: the run it exports is the one trained above
PLACEHOLDERS = {"runs/x": "runs/s-diff", "hf/y": "hf/x", " [--step N]": "", " [--set data.tokenizer=cl100k_base]": ""}


def recipe_commands() -> list[str]:
    """`diffjax …` / `make …` lines of the recipe files' indented code blocks (continuations joined, comments
    dropped), file by file."""
    commands = []
    for path in RECIPE_FILES:
        lines, in_block, previous_blank = path.read_text().splitlines(), False, True
        i = 0
        while i < len(lines):
            line = lines[i]
            in_block = line.startswith("    ") and (in_block or previous_blank)
            if in_block:
                text = line.strip()
                while text.endswith("\\"):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                if text.startswith(("diffjax ", "make ")):
                    commands.append(re.sub(r"\s+#\s.*$", "", text).rstrip(" &"))
            previous_blank = not line.strip()
            i += 1
    return commands


def _starts(command: str, prefix: str) -> bool:
    return command == prefix or command.startswith(prefix + " ")


def classify(command: str) -> str | None:
    matches = [reason for prefix, reason in CLASSIFIED if _starts(command, prefix)]  # the first (most specific)
    assert matches, f"recipe command not classified in tests/test_readme.py: {command}"
    return matches[0]


def test_every_readme_command_is_classified_and_every_classification_is_used():
    commands = recipe_commands()
    for command in commands:
        classify(command)
    unused = [prefix for prefix, _ in CLASSIFIED if not any(_starts(c, prefix) for c in commands)]
    assert not unused, f"classified but no longer in {[p.name for p in RECIPE_FILES]}: {unused}"


def _shortened(command: str) -> list[str]:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)
    if argv[:2] in (["diffjax", "train"], ["diffjax", "sweep"]) and "--report" not in argv:
        short = SHORT + (SHORT_OWN_DATA if "data.source=shards" in argv else [])
        argv += [a for s in short for a in ("--set", s)] + ["--no-progress"]
    return argv


@pytest.mark.slow
@pytest.mark.optimized
def test_the_readme_recipes_run_as_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus").mkdir()
    words = "the of and a to in is was for on with as by at from his her they which".split()
    for f in range(2):  # a few KB of text for the own-data recipe
        text = "\n\n".join(" ".join(words[(7 * p + 3 * w + f) % len(words)] for w in range(120)) for p in range(30))
        (tmp_path / "corpus" / f"{f}.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    ran = []
    for command in recipe_commands():
        if classify(command) is not None:
            continue
        argv = _shortened(command)
        if not ran:  # the user's process: the console script from the virtualenv, one CPU device
            exe = Path(sys.executable).parent / "diffjax"
            out = subprocess.run([str(exe), *argv[1:]], env=cli_env(), capture_output=True, text=True, timeout=600)
            code, output = out.returncode, out.stdout[-2000:] + out.stderr[-3000:]
        else:
            code = cli.main(argv[1:])
            output = "".join(capsys.readouterr())[-5000:]
        assert code == 0, f"recipe command failed ({code}): {' '.join(argv)}\n{output}"
        ran.append(argv[1])
    assert len(ran) >= 10, ran
    assert (tmp_path / "runs" / "s-diff" / "telemetry.png").exists()
    assert (tmp_path / "hf" / "x" / "model.safetensors").exists() or any((tmp_path / "hf" / "x").glob("*.safetensors"))

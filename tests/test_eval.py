"""Evaluation: `diffjax train` → `diffjax eval` on the retrieval task (accuracy by depth, PNG report), the CLI's
protocols and `--compare` (every arch's attention maps: tests/test_arch_conformance.py)."""

import contextlib
import dataclasses
import functools
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from helpers import REPO

from diffjax import cli
from diffjax import config as config_lib
from diffjax import eval as eval_lib
from diffjax.eval.command import check_overrides

# Short quickstart runs, DIFF and its matched Transformer, trained through `diffjax train` once per test session
# and copied into each test that reads them (evaluation writes into the run directory).
QUICK = ["model.d_model=32", "model.head_dim=16", "data.seq_len=192", "data.batch_size=8", "data.n_needles=2",
         "train.steps=3", "train.eval_every=3", "train.eval_batches=1", "train.checkpoint_every=3",
         "optim.warmup_steps=1"]
QUICK_ARCHS = {"diff": ["model.n_heads=1"], "transformer": ["model.arch=transformer", "model.n_heads=2"]}


@pytest.fixture(scope="session")
def quick_run(built_once):
    """quick_run(arch, into) -> (the run copied to `into`, what `diffjax train` printed); each arch trained once per
    test session."""
    def build(arch, directory):
        args = ["train", "--config", "configs/quickstart.py", "--workdir", str(directory / "run"), "--no-progress"]
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert cli.main(args + [a for o in QUICK + QUICK_ARCHS[arch] for a in ("--set", o)]) == 0
        (directory / "printed.txt").write_text(printed.getvalue())

    def get(arch: str, into):
        trained = built_once(f"quick_run-{arch}", functools.partial(build, arch))
        shutil.copytree(trained / "run", into)
        return into, (trained / "printed.txt").read_text()

    return get


@pytest.mark.slow  # end to end through the CLI
def test_train_then_eval_reports_retrieval_and_a_png(quick_run, tmp_path, capsys, monkeypatch):
    run, printed = quick_run("diff", tmp_path / "diff")
    summary = json.loads((run / "summary.json").read_text())
    assert f"final validation loss: {summary['val_loss']:.4f}" in printed
    acc = summary["retrieval_accuracy"]
    assert sorted(acc["by_depth"]) == ["0.0", "0.25", "0.5", "0.75", "1.0"]
    assert acc["mean"] == pytest.approx(np.mean(list(acc["by_depth"].values())))
    assert 0 <= acc["answer_token_accuracy"] <= 1
    image = matplotlib.image.imread(summary["report_png"])
    assert image.ndim == 3 and image.shape[0] > 0.6 * image.shape[1]  # one compact page, not a strip of panels

    assert cli.main(["eval", "--workdir", str(run), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["step"] == 3
    assert evaluated["validation"]["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert evaluated["retrieval"] == acc  # same parameters, same seeded examples
    assert cli.main(["eval", "--workdir", str(run)]) == 0  # the default: tables, files, what else there is
    out, err = capsys.readouterr()
    assert "[1/2] validation on" in err and "[2/2] retrieval on" in err and "about" in err
    assert "## validation" in out and "## retrieval" in out and "| run | depth 0%" in out
    assert f"wrote {run / 'eval' / 'retrieval.json'}, {run / 'eval' / 'retrieval.md'}" in out
    others = out.split("more protocols for this run: ")[1].split(" (--protocol")[0].split(", ")
    assert {"needle", "attention_noise"} <= set(others) <= set(eval_lib.names()) - {"validation", "retrieval"}
    # each protocol is written and shown as it finishes: a later one failing loses none of the earlier ones
    shutil.rmtree(run / "eval")

    def killed(cfg, params):
        raise RuntimeError("killed")

    monkeypatch.setitem(eval_lib._REGISTRY, "retrieval", dataclasses.replace(eval_lib.get("retrieval"), run=killed))
    with pytest.raises(RuntimeError, match="killed"):
        cli.main(["eval", "--workdir", str(run)])
    assert "## validation" in capsys.readouterr().out
    assert json.loads((run / "eval" / "validation.json").read_text())["loss"] == evaluated["validation"]["loss"]



class _Oracle:
    """A stand-in model that predicts every target right, except a "7", which it always gets wrong. It looks the
    targets up by each row's tokens (`known`: filled by the test from the same seeded examples)."""

    known: dict = {}

    def __init__(self, cfg):
        self.vocab = cfg.vocab_size

    def apply(self, variables, tokens, positions, segment_ids, keep_layout=False):
        def guess(tokens):
            targets = np.stack([_Oracle.known[row.tobytes()] for row in np.asarray(tokens, np.int32)])
            return np.where(targets == ord("7"), ord("8"), targets).astype(np.int32)

        shape = jax.ShapeDtypeStruct(tokens.shape, jnp.int32)
        return jax.nn.one_hot(jax.pure_callback(guess, shape, tokens), self.vocab)


def test_retrieval_counts_an_example_only_when_its_whole_answer_is_right(monkeypatch):
    """Expected from the examples' own magic numbers: retrieved iff the number has no 7."""
    from diffjax.data.synthetic import retrieval_examples
    from diffjax.eval import retrieval, scoring

    cfg = config_lib.load("configs/quickstart.py", ["data.n_needles=2"])
    monkeypatch.setattr(scoring, "DecoderLM", _Oracle)
    scoring._greedy.cache_clear()  # compiled forwards are cached per model config: none of the real model's
    n, depths = 40, (0.0, 0.5, 1.0)
    hits, token_accuracy = [], []
    for depth in depths:
        batch = retrieval_examples(cfg.data, n, depth=depth)
        for tokens, targets in zip(np.asarray(batch["tokens"], np.int32), np.asarray(batch["targets"]), strict=True):
            _Oracle.known[tokens.tobytes()] = targets
        numbers = [str(int(x)) for x in batch["numbers"][:, 0]]
        hits.append(np.mean(["7" not in x for x in numbers]))
        answer = "".join(f" {x}" for x in numbers)  # each answer: a space, then the number
        token_accuracy.append(1 - answer.count("7") / len(answer))
    try:  # 40 examples in batches of 6: streamed, the last batch padded
        result = retrieval.retrieval_accuracy(cfg, {"unused": np.zeros(1)}, n=n, depths=depths, batch_size=6)
    finally:
        scoring._greedy.cache_clear()
    assert 0 < min(hits) and max(hits) < 1  # both outcomes occur
    assert [result["by_depth"][d] for d in depths] == pytest.approx(hits)
    assert result["mean"] == pytest.approx(np.mean(hits))
    assert result["answer_token_accuracy"] == pytest.approx(np.mean(token_accuracy))


def test_eval_of_a_directory_without_a_run_or_a_checkpoint_fails_clearly(tmp_path, capsys):
    assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
    assert "is not a run directory: it has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(config_lib.load("configs/quickstart.py").to_json())
    assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
    assert "holds no readable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_cli_on_diff_and_transformer_with_a_compare(quick_run, tmp_path, capsys):
    """Each protocol that applies runs from the CLI on a short DIFF run and a short Transformer run, writing
    eval/NAME.{json,md,png}; --compare puts both runs in one table and one figure; bad requests exit 2."""
    runs = QUICK_ARCHS
    for name in runs:
        quick_run(name, tmp_path / name)
    for name in runs:
        assert cli.main(["eval", "--workdir", str(tmp_path / name), "--json", "--protocol", "attention_noise",
                         "--set", "eval.n=4", "--set", "eval.depths=0.0,1.0"]) == 0
        result = json.loads(capsys.readouterr().out)["attention_noise"]
        assert len(result["answer"]) == 2
        assert json.loads((tmp_path / name / "eval" / "attention_noise.json").read_text())["answer"] == \
            result["answer"]
        assert "answer" in (tmp_path / name / "eval" / "attention_noise.md").read_text()
        assert matplotlib.image.imread(tmp_path / name / "eval" / "attention_noise.png").ndim == 3

    assert cli.main(["eval", "--compare", str(tmp_path / "diff"), str(tmp_path / "transformer"), "--protocol",
                     "retrieval", "--set", "eval.n=4", "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "retrieval.md").read_text()
    labels = ["diff (diff, step 3)", "transformer (transformer, step 3)"]  # each run's directory, arch and step
    assert all(f"| {label} |" in table for label in labels), table
    both = json.loads((tmp_path / "cmp" / "retrieval.json").read_text())
    assert sorted(both) == labels and all(r["step"] == 3 for r in both.values())
    assert (tmp_path / "cmp" / "retrieval.png").stat().st_size > 0

    capsys.readouterr()
    bad = [["--protocol", "nope"], ["--protocol", "retrieval", "--set", "eval.bogus=1"],
           ["--protocol", "needle", "--set", "eval.lengths=4096"]]
    for extra in bad:
        assert cli.main(["eval", "--workdir", str(tmp_path / "diff"), *extra]) == 2, extra
        assert capsys.readouterr().err


def test_eval_set_takes_where_and_on_what_a_checkpoint_is_evaluated_not_what_it_is():
    """`diffjax eval --set` takes the fields marked `eval` (`config.setting`): the mesh and the data whole (a key
    there the override itself names, if unknown), how attention and the loss are laid out, how many batches; any
    other key is part of what the checkpoint is, refused naming what it takes."""
    settable = {k for k in config_lib.fields_where("eval") if not k.endswith(".*")}
    sections = {f.name: f.default for f in dataclasses.fields(config_lib.Config) if dataclasses.is_dataclass(f.default)}
    assert settable == {f"{s}.{f.name}" for s in ("mesh", "data") for f in dataclasses.fields(sections[s])} | {
        "model.attention_impl", "model.context_strategy", "model.remat", "model.loss_chunk", "train.eval_batches"}
    for key in (*settable, "mesh.bogus", "data.bogus"):
        check_overrides([f"{key}=1"])
    for key in ("model.n_layers", "model.arch", "optim.lr", "train.steps", "train.seed", "name", "mesh", "model.bogus"):
        with pytest.raises(config_lib.ConfigError, match=rf"^--set {key}=1: {key} is part of what the checkpoint is "
                           r".* takes data\.\*, mesh\.\*, model\.attention_impl, model\.context_strategy, "
                           r"model\.remat, model\.loss_chunk, train\.eval_batches and eval\.\*"):
            check_overrides([f"{key}=1"])


@pytest.mark.slow
@pytest.mark.optimized
def test_evaluation_at_long_context_stays_within_half_again_of_trainings_memory(tmp_path):
    """The end of a context-parallel run (retrieval, report.png) at 1,024 tokens over 8 devices, in a fresh process:
    its peak resident size within 1.5× of training's, and retrieval alone (streamed in training-sized, sharded
    batches) within 1.05×."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, "experiments/bench_eval_memory.py", "--seq-len", "1024", "--protocols", "",
                    "--json", str(tmp_path / "memory.json")], cwd=REPO, env=env, capture_output=True, text=True,
                   timeout=600, check=True)
    result = json.loads((tmp_path / "memory.json").read_text())
    train, after = result["train_peak_gib"], result["after"]
    assert after["retrieval (end of diffjax train)"] <= 1.05 * train, result
    assert after["report.png (end of diffjax train)"] <= 1.5 * train, result

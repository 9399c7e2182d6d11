"""`diffjax hf export / import`: a trained DIFF run leaves diffjax and comes back as an ordinary run directory with
equal logits; bad input exits 2 with the problem named."""

import dataclasses

import numpy as np
import pytest
from test_hf import FIXTURES, TINY_DIFF, copy_fixture, edit_config, logits, rel_err, trained_diff

from diffjax.cli import main
from diffjax.hf import load_pretrained
from diffjax.hf.run import import_run
from diffjax.train.loop import load_run

CFG = dataclasses.replace(TINY_DIFF, vocab_size=512)  # the byte tokenizer's vocabulary
IDS = np.arange(24).reshape(2, 12) * 5 % CFG.vocab_size


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory holding a 'trained' DIFF model (learned head-norm scale and λ vectors)."""
    workdir = tmp_path_factory.mktemp("trained")
    params = trained_diff(CFG)
    import_run(None, workdir, ["train.steps=10"], model_cfg=CFG, params=params)
    return workdir, params


def test_export_then_import_round_trips_through_the_cli(trained_run, tmp_path, capsys):
    workdir, params = trained_run
    assert main(["hf", "export", "--workdir", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    assert "no Hugging Face tokenizer" in (tmp_path / "hf" / "tokenizer.md").read_text()
    cfg, exported = load_pretrained(tmp_path / "hf")
    assert rel_err(logits(cfg, exported, IDS), logits(CFG, params, IDS)) <= 1e-5
    assert main(["hf", "import", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run"),
                 "--set", "train.steps=10"]) == 0
    run_cfg, state, _ = load_run(tmp_path / "run")
    assert int(state.step) == 0 and run_cfg.model == cfg
    assert rel_err(logits(run_cfg.model, state.params, IDS), logits(CFG, params, IDS)) <= 1e-5


def test_export_of_a_missing_step_exits_2(trained_run, tmp_path, capsys):
    assert main(["hf", "export", "--workdir", str(trained_run[0]), "--step", "7", "--out", str(tmp_path)]) == 2
    assert "--step 7" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 128}, "mismatched config.json"),
    (None, "no config.json"),
    ({}, "vocab_size"),  # 96 ids: too few for the byte tokenizer a run defaults to
])
def test_bad_imports_exit_2_naming_the_problem(tmp_path, capsys, change, message):
    path = copy_fixture(tmp_path)
    if change is None:
        (path / "config.json").unlink()
    else:
        edit_config(path, **change)
    assert main(["hf", "import", str(path), "--workdir", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_import_refuses_changing_the_checkpoint_shape(tmp_path, capsys):
    args = ["hf", "import", str(FIXTURES / "llama"), "--workdir", str(tmp_path / "run"),
            "--set", "data.tokenizer=cl100k_base", "--set", "model.n_layers=3"]
    assert main(args) == 2
    assert "model.n_layers" in capsys.readouterr().err

"""`diffjax hf export / import`: a trained DIFF run leaves diffjax and comes back as an ordinary run directory with
equal logits (`diffjax eval` works on it); `--step N` exports step N; bad input exits 2 with the problem named, as
does `diffjax lm-eval` without lm-eval installed. Where torch and transformers are installed, a run trained by
`diffjax train` and exported by the CLI loads in transformers with equal logits, and the cl100k tokenizer recipe
that an export writes is run."""

import dataclasses
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import MICRO, REPO, TINY, sets
from safetensors.numpy import load_file, save_file
from test_hf import FIXTURES, LIVE, TINY_DIFF, copy_fixture, edit_config, logits, rel_err, trained_diff
from test_hf import transformers_logits as hf_logits

from diffjax.cli import main
from diffjax.config import Config
from diffjax.data.pipeline import validation_iterator
from diffjax.data.tokenizer import CL100K_VOCAB, cl100k_file, get_tokenizer
from diffjax.hf import load_pretrained
from diffjax.hf.run import import_run
from diffjax.model import DecoderLM, layer_lambdas, per_layer
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.optim import make_optimizer
from diffjax.train.run_loader import load_run
from diffjax.train.state import init_state, state_shardings

CFG = dataclasses.replace(TINY_DIFF, vocab_size=512)  # the byte tokenizer's vocabulary
IDS = np.arange(24).reshape(2, 12) * 5 % CFG.vocab_size


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory holding a 'trained' DIFF model (learned head-norm scale and λ vectors)."""
    workdir = tmp_path_factory.mktemp("trained")
    params = trained_diff(CFG)
    import_run(None, workdir, ["train.steps=10"], model_cfg=CFG, params=params)
    return workdir, params


@pytest.mark.slow  # end to end through the CLI
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
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "diffjax loads only DiffLlamaForCausalLM, LlamaForCausalLM, "
     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 128}, "mismatched config.json"),
    (None, "has no config.json, so it is not a Hugging Face model directory"),
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


def test_import_of_a_missing_path_or_a_run_directory_says_what_it_is(trained_run, tmp_path, capsys):
    for path, message in ((tmp_path / "nowhere", "does not exist; expected a Hugging Face model directory"),
                          (trained_run[0], "is a diffjax run directory, not a Hugging Face model directory")):
        assert main(["hf", "import", str(path), "--workdir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert f"{path} {message}" in err, err
        assert "architectures" not in err


def test_an_export_carries_token_ids_file_modes_and_the_runs_settings(trained_run, tmp_path, capsys):
    """config.json and generation_config.json name diffjax's byte EOS / pad ids (not DiffLlama's 1 / 2); the weights
    are as readable as the other files; an import of the export trains and evaluates with the run's data and
    optimizer settings, not the defaults."""
    workdir, _ = trained_run
    out = tmp_path / "hf"
    assert main(["hf", "export", "--workdir", str(workdir), "--out", str(out)]) == 0
    tok = get_tokenizer("byte")
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((out / name).read_text())
        assert (ids["eos_token_id"], ids["pad_token_id"], ids["bos_token_id"]) == (tok.eos_id, tok.pad_id, tok.eos_id)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    # a run with other data / optimizer settings than the defaults comes back with them
    src = tmp_path / "src"
    import_run(None, src, ["train.steps=10", "data.seq_len=320", "data.batch_size=3", "optim.lr=7e-4", "data.seed=5"],
               model_cfg=CFG, params=trained_run[1])
    assert main(["hf", "export", "--workdir", str(src), "--out", str(tmp_path / "hf2")]) == 0
    assert main(["hf", "import", str(tmp_path / "hf2"), "--workdir", str(tmp_path / "back")]) == 0
    (back, _, _), (original, _, _) = load_run(tmp_path / "back"), load_run(src)
    assert (back.data, back.optim, back.train.steps) == (original.data, original.optim, original.train.steps)


def test_import_refuses_changing_the_checkpoint_shape(tmp_path, capsys):
    args = ["hf", "import", str(FIXTURES / "llama"), "--workdir", str(tmp_path / "run"),
            "--set", "data.tokenizer=cl100k_base", "--set", "model.n_layers=3"]
    assert main(args) == 2
    assert "model.n_layers" in capsys.readouterr().err


def test_export_step_n_exports_that_steps_params(tmp_path, capsys):
    """A run with checkpoints at steps 0 and 5 (known, different params): `--step 0` exports step 0's params,
    the default the latest step's."""
    workdir = tmp_path / "run"
    early, late = trained_diff(CFG, seed=0), trained_diff(CFG, seed=7)
    import_run(None, workdir, ["train.steps=10"], model_cfg=CFG, params=early)
    cfg, state, mesh = load_run(workdir)
    ckpt = Checkpointer(workdir / "checkpoints", 3, async_save=False)
    _, state, data = ckpt.restore_latest(state_shardings(cfg, mesh, make_optimizer(cfg.optim, cfg.train.steps))[0])
    ckpt.save(5, state.replace(step=state.step + 5, params=jax.device_put(late, jax.tree.map(
        lambda x: x.sharding, state.params))), data)
    ckpt.close()
    for step, params, other in ((["--step", "0"], early, late), ([], late, early)):
        out = tmp_path / f"hf{step}"
        assert main(["hf", "export", "--workdir", str(workdir), *step, "--out", str(out)]) == 0
        cfg2, exported = load_pretrained(out)
        ours = logits(cfg2, exported, IDS)
        assert rel_err(ours, logits(CFG, params, IDS)) <= 1e-5
        assert rel_err(ours, logits(CFG, other, IDS)) > 0.1


def test_lm_eval_without_the_eval_extra_exits_2(trained_run, monkeypatch, capsys):
    # imported first with lm-eval present, as the tests after this one need it (it binds lm-eval's LM when imported)
    import diffjax.eval.lm_harness  # noqa: F401

    for name in ["lm_eval", *(m for m in sys.modules if m.startswith("lm_eval."))]:  # as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["lm-eval", "--workdir", str(trained_run[0]), "--tasks", "arc_easy"]) == 2
    assert "pip install 'diffjax[eval]'" in capsys.readouterr().err


def pad_vocab(path, vocab: int, seed: int = 0):
    """The HF checkpoint at `path` with `vocab` ids: new random embedding and head rows after the old ones."""
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight")[:1 + ("lm_head.weight" in tensors)]:
        old = tensors[name]
        new = (0.2 * rng.standard_normal((vocab - old.shape[0], old.shape[1]))).astype(old.dtype)
        tensors[name] = np.concatenate([old, new])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    edit_config(path, vocab_size=vocab)
    return path


@pytest.mark.slow  # end to end through the CLI
def test_diffjax_eval_on_the_imported_golden_diffllama(tmp_path, capsys):
    """The golden HF DiffLlama (its vocabulary padded to the byte tokenizer's 512 ids) imported by the CLI is
    still the golden model, and `diffjax eval --protocol validation` on it gives the validation loss computed here
    directly from the loaded params (no jit, no sharding, float64 softmax)."""
    hf = pad_vocab(copy_fixture(tmp_path), CFG.vocab_size)
    run = tmp_path / "run"
    overrides = ["data.seq_len=64", "data.batch_size=4", "data.tasks=mqar", "data.mqar_pairs=6",
                 "data.mqar_queries=6", "train.eval_batches=2", "mesh.data=1"]
    assert main(["hf", "import", str(hf), "--workdir", str(run), *sets(overrides)]) == 0
    cfg, state, _ = load_run(run)
    golden = load_file(str(FIXTURES / "diffllama" / "golden.safetensors"))
    assert rel_err(logits(cfg.model, state.params, golden["ids"])[..., :96], golden["logits"]) <= 1e-4
    assert main(["eval", "--workdir", str(run), "--protocol", "validation"]) == 0
    got = json.loads((run / "eval" / "validation.json").read_text())

    model_cfg, params = load_pretrained(hf)
    data, loss_sum, count = validation_iterator(cfg.data), 0.0, 0.0
    for _ in range(cfg.train.eval_batches):
        batch = data.next()
        out = np.asarray(DecoderLM(model_cfg).apply({"params": params}, batch["tokens"], batch["positions"],
                                                    batch["segment_ids"]), np.float64)
        logp = out - out.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]
        mask = np.asarray(batch["loss_mask"], np.float64)
        loss_sum, count = loss_sum + (nll * mask).sum(), count + mask.sum()
    data.close()
    assert count > 0 and np.isfinite(got["loss"])
    assert abs(got["loss"] - loss_sum / count) <= 1e-5 * loss_sum / count, (got["loss"], loss_sum / count)


@pytest.mark.slow  # end to end through the CLI
def test_a_qwen_comes_in_and_goes_out_through_the_cli_as_itself(tmp_path):
    """The golden Qwen2 (biases, tied head; its vocabulary padded to the byte tokenizer's) imported by the CLI and
    exported again: a Qwen2ForCausalLM, every tensor bit for bit (the run's config.json keeps the class)."""
    hf = pad_vocab(copy_fixture(tmp_path, "qwen2"), CFG.vocab_size)
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "run")]) == 0
    assert main(["hf", "export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ours, theirs = (load_file(str(path / "model.safetensors")) for path in (tmp_path / "out", hf))
    assert set(ours) == set(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)


@pytest.fixture(scope="module")
def cl100k_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("cl100k")
    cfg = dataclasses.replace(CFG, vocab_size=CL100K_VOCAB)
    import_run(None, root / "run", ["data.tokenizer=cl100k_base", "train.steps=10"], model_cfg=cfg,
               params=trained_diff(cfg))
    assert main(["hf", "export", "--workdir", str(root / "run"), "--out", str(root / "hf")]) == 0
    return root / "hf"


def test_an_export_says_how_to_get_its_tokenizer(cl100k_export, trained_run, tmp_path, capsys):
    note = (cl100k_export / "tokenizer.md").read_text()
    assert "cl100k_base" in note and "AutoTokenizer" in note and "100257" in note
    assert f'out = "{cl100k_export}"' in note  # the recipe writes into this export
    assert main(["hf", "export", "--workdir", str(trained_run[0]), "--out", str(tmp_path)]) == 0
    note = (tmp_path / "tokenizer.md").read_text()
    assert "byte tokenizer" in note and "no Hugging Face tokenizer" in note and "cl100k" not in note


@LIVE
def test_the_cl100k_recipe_gives_diffjax_token_ids_in_transformers(cl100k_export, monkeypatch):
    """The note's Python block, run as written (tiktoken's download served from a seeded cache): AutoTokenizer
    then gives diffjax's ids, <|endoftext|> included."""
    pytest.importorskip("blobfile")  # convert_tiktoken_to_fast writes the vocabulary with it
    from transformers import AutoTokenizer

    cache = cl100k_export.parent / "tiktoken-cache"
    cache.mkdir()
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    shutil.copy(cl100k_file(), cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    note = (cl100k_export / "tokenizer.md").read_text()
    exec(re.search(r"```python\n(.*?)```", note, re.S).group(1), {})
    tokenizer, ours = AutoTokenizer.from_pretrained(cl100k_export), get_tokenizer("cl100k_base")
    for text in ("Differential attention cancels noise.\n\n  naïve café 日本語 12345\t😀", "x" * 40 + " \r\n y"):
        assert tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    assert tokenizer.eos_token_id == ours.eos_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.decode(ours.encode("a") + [ours.eos_id]) == "a<|endoftext|>"


@pytest.mark.slow  # end to end through the CLI
@LIVE
def test_a_trained_run_exported_by_the_cli_loads_in_transformers(tmp_path, capsys):
    """`diffjax train` (a few steps at a high learning rate: head-norm scales and λ vectors move off their init),
    then `diffjax hf export`: transformers' AutoModelForCausalLM computes diffjax's logits."""
    run = tmp_path / "run"
    overrides = [*MICRO, "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8", "model.dtype=float32",
                 "train.steps=3", "optim.lr=1e-2", "optim.warmup_steps=0"]
    assert main(["train", "--config", TINY, *sets(overrides), "--workdir", str(run), "--no-progress"]) == 0
    cfg, state, mesh = load_run(run)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    init = init_state(cfg, tx, state_shardings(cfg, mesh, tx)[1]).params  # where training started
    assert int(state.step) == 3 and cfg.model.arch == "diff"
    for now, then in zip(per_layer(state.params, cfg.model), per_layer(init, cfg.model), strict=True):
        scale, scale0 = (np.asarray(layer["attn"]["head_norm"]["scale"]) for layer in (now, then))
        assert np.abs(scale - scale0).max() > 1e-3 and np.abs(scale - 1).max() > 1e-3
    lam, lam0 = layer_lambdas(state.params, cfg.model), layer_lambdas(init, cfg.model)
    assert np.abs(np.asarray(lam) - np.asarray(lam0)).min() > 1e-4
    assert main(["hf", "export", "--workdir", str(run), "--out", str(tmp_path / "hf")]) == 0
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 32))
    err = rel_err(logits(cfg.model, state.params, ids), hf_logits(tmp_path / "hf", ids))
    print(f"trained run via the CLI: max relative logit error vs transformers {err:.2e}")
    assert err <= 1e-4


@LIVE
def test_generate_stops_at_the_end_of_a_document_in_transformers(trained_run, tmp_path, capsys):
    """transformers' generate() on an export reads its generation_config: EOS is diffjax's (256 for bytes), so a
    model that always predicts EOS stops after one token instead of running to max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    workdir, params = trained_run
    eos = get_tokenizer("byte").eos_id
    # every layer adds nothing (output projections zero), so the last hidden state is the token's embedding, e0 for
    # every token; the output matrix maps e0 to EOS ten times more strongly than to any other token
    zero_outputs = lambda path, x: np.zeros_like(x) if any(  # noqa: E731
        getattr(k, "key", None) in ("wo", "w_down") for k in path) else np.array(x, copy=True)
    params = jax.tree_util.tree_map_with_path(zero_outputs, params)
    e0 = np.zeros(CFG.d_model, np.float32)
    e0[0] = 1.0
    params["embed"]["embedding"][:] = e0
    if "lm_head" in params:
        params["lm_head"]["kernel"][:] = e0[:, None]
        params["lm_head"]["kernel"][:, eos] = 10 * e0
    else:
        params["embed"]["embedding"][eos] = 10 * e0
    run = tmp_path / "eos_run"
    import_run(None, run, ["train.steps=10"], model_cfg=CFG, params=params)
    assert main(["hf", "export", "--workdir", str(run), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.generation_config.eos_token_id == eos
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False)
    assert out[0, 3:].tolist() == [eos]


# ------------------------------------------------------------------------------- a checkpoint's own tokenizer
TOKENIZER = FIXTURES.parent / "tokenizer"  # a byte-level BPE tokenizer of 440 ids (tests/test_tokenizer.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"


def with_tokenizer(hf):
    """`hf` with the fixture's tokenizer files and a chat template, as a checkpoint ships them."""
    for name in TOKENIZER_FILES[:2]:
        shutil.copy(TOKENIZER / name, hf / name)
    (hf / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return hf


def snapshot(directory) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tokenizer_run(tmp_path_factory):
    """The golden Llama (vocabulary padded to 512 ids) with the fixture's tokenizer, imported by the CLI into a run
    that trains on a text corpus, and exported again."""
    root = tmp_path_factory.mktemp("tokenizer_run")
    hf = with_tokenizer(pad_vocab(copy_fixture(root, "llama"), 512))
    (root / "corpus.txt").write_text("\n\n".join(["Differential attention cancels noise.", "naïve café 日本語 😀",
                                                  "<|endoftext|> is text here", "tabs\tand  spaces\n"] * 8))
    overrides = ["data.source=text", f"data.path={root / 'corpus.txt'}", "data.seq_len=32", "data.batch_size=2",
                 "train.steps=10"]
    assert main(["hf", "import", str(hf), "--workdir", str(root / "run"), *sets(overrides)]) == 0
    assert main(["hf", "export", "--workdir", str(root / "run"), "--out", str(root / "export")]) == 0
    return hf, root / "run", root / "export"


def test_an_import_brings_the_checkpoints_tokenizer_and_an_export_writes_it_back(tokenizer_run):
    """The run's data.tokenizer is its own copy of the checkpoint's (config.json names it relatively; SHA256SUMS
    holds each file's sha256); the export holds the same files (the chat template too), and its config.json /
    generation_config.json the tokenizer's own BOS / EOS (AutoTokenizer's, in the golden file) and no pad id: the
    tokenizer has no pad token, and the id diffjax pads with (past its 440 ids) is no id of the tokenizer.json the
    export carries."""
    hf, run, export = tokenizer_run
    golden = json.loads((TOKENIZER / "golden.json").read_text())
    assert json.loads((run / "config.json").read_text())["data"]["tokenizer"] == "tokenizer"
    assert load_run(run)[0].data.tokenizer == str((run / "tokenizer").resolve())
    sums = dict(line.split()[::-1] for line in (run / "tokenizer" / "SHA256SUMS").read_text().splitlines())
    assert sums == {name: hashlib.sha256((hf / name).read_bytes()).hexdigest() for name in TOKENIZER_FILES}
    for name in TOKENIZER_FILES:
        assert (export / name).read_bytes() == (hf / name).read_bytes() == (run / "tokenizer" / name).read_bytes()
    assert not (export / "tokenizer.md").exists() and not (export / "SHA256SUMS").exists()
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((export / name).read_text())
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (golden["bos_id"], golden["eos_id"])
        assert golden["pad_id"] is None and "pad_token_id" not in ids


@LIVE
def test_an_exported_tokenizer_loads_in_transformers_with_diffjaxs_ids(tokenizer_run):
    from transformers import AutoTokenizer

    _, run, export = tokenizer_run
    ours, auto = get_tokenizer(str(run / "tokenizer")), AutoTokenizer.from_pretrained(export)
    golden = json.loads((TOKENIZER / "golden.json").read_text())
    for case in golden["texts"]:
        assert auto(case["text"], add_special_tokens=False, split_special_tokens=True).input_ids == \
            ours.encode(case["text"]) == case["ids"]
    assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_a_changed_tokenizer_file_is_refused_at_resume(tokenizer_run, tmp_path, capsys):
    """`diffjax train --workdir RUN` after RUN/tokenizer/tokenizer.json changed: one line naming the file, exit 2,
    and nothing in the run directory changes."""
    run = Path(shutil.copytree(tokenizer_run[1], tmp_path / "run"))
    file = run / "tokenizer" / "tokenizer.json"
    file.write_text(file.read_text().replace('"<s>"', '"<S>"', 1))
    before = snapshot(run)
    assert main(["train", "--workdir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{file}: changed since the run copied it" in err, err
    assert snapshot(run) == before


def test_an_embedding_smaller_than_the_checkpoints_tokenizer_is_refused(tmp_path, capsys):
    """The golden Llama's 96 embedding rows cannot hold the tokenizer's 440 ids: one line naming both, exit 2, no
    run directory."""
    hf = with_tokenizer(copy_fixture(tmp_path, "llama"))
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "run"), "--set", "data.source=text",
                 "--set", "data.path=corpus.txt"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.vocab_size: 96 ids cannot embed" in err and "up to 439" in err, err
    assert not (tmp_path / "run").exists()


def test_every_command_takes_the_same_relative_workdir_of_an_imported_run(tokenizer_run, tmp_path, monkeypatch,
                                                                          capsys):
    """An imported run with its own tokenizer, named relatively as the docs do: generate, hf export, eval and
    lm-eval all take `--workdir runs/imported` from the directory above it, and generate `--workdir imported` from
    inside runs/ (the run's tokenizer path was once joined to the workdir twice)."""
    pytest.importorskip("lm_eval")
    from test_lm_harness import COMMON, TASKS

    shutil.copytree(tokenizer_run[1], tmp_path / "runs" / "imported")
    name = "diffjax_tiny_rolling"
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **COMMON, **TASKS[name]}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = ["--workdir", "runs/imported"]
    capsys.readouterr()
    assert main(["generate", *run, "--prompt", "naïve café", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("naïve café")
    assert main(["hf", "export", *run, "--out", "hf/out"]) == 0
    assert (tmp_path / "hf" / "out" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    capsys.readouterr()
    assert main(["eval", *run, "--protocol", "validation", "--set", "mesh.data=1", "--json"]) == 0
    assert np.isfinite(json.loads(capsys.readouterr().out)["validation"]["loss"])
    assert main(["lm-eval", *run, "--tasks", name, "--include", ".", "--limit", "2", "--max-length", "32"]) == 0
    assert (tmp_path / "runs" / "imported" / "eval" / "lm_eval.json").is_file()
    monkeypatch.chdir(tmp_path / "runs")
    capsys.readouterr()
    # 3 new tokens, as above: the prompt is padded to the context less them, so the same programs
    assert main(["generate", "--workdir", "imported", "--prompt", "tabs", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("tabs")


def test_an_import_with_no_settings_takes_a_tokenizer_whose_eos_id_is_2(tmp_path, monkeypatch, capsys):
    """`hf import DIR` and `hf import DIR --as diff`, nothing set, for a checkpoint whose tokenizer ends text with
    id 2 (as SmolLM2's): the import reads no data, so the synthetic default mixture (whose MQAR task needs ids below
    the end of text) is no reason to refuse it; the data is checked where it is read, one line naming the fix."""
    hf = with_tokenizer(pad_vocab(copy_fixture(tmp_path, "llama"), 512))
    assert json.loads((TOKENIZER / "golden.json").read_text())["eos_id"] == 2
    monkeypatch.chdir(tmp_path)
    assert main(["hf", "import", hf.name, "--workdir", "runs/plain"]) == 0
    assert main(["hf", "import", hf.name, "--as", "diff", "--workdir", "runs/diff"]) == 0
    for run, arch in (("plain", "transformer"), ("diff", "diff")):
        cfg, state, _ = load_run(tmp_path / "runs" / run)
        assert (cfg.model.arch, int(state.step), cfg.data.source) == (arch, 0, "synthetic")
        assert get_tokenizer(cfg.data.tokenizer).eos_id == 2
    capsys.readouterr()
    assert main(["eval", "--workdir", "runs/plain", "--protocol", "validation"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # a progress line, then the error
    assert err[-1].startswith("data error: data.tasks: MQAR draws its ids between 32 and the end-of-text id") and \
        err[-1].endswith("leave mqar out (data.tasks=retrieval) or use a text source"), err


def test_a_failed_export_leaves_nothing_that_looks_finished(trained_run, tmp_path, monkeypatch, capsys):
    """The storage refuses the export's last files (after config.json and the weights): exit 1, one line saying
    nothing was written, and no `--out` directory or partial one beside it. An `--out` that holds files is refused
    before anything is written, and its files stay as they were."""
    import errno

    from diffjax.hf import run as hf_run

    def full_disk(cfg, into, out):
        assert (into / "config.json").is_file() and (into / "model.safetensors").is_file()  # midway
        raise OSError(errno.ENOSPC, "No space left on device", str(into / "tokenizer.md"))

    monkeypatch.setattr(hf_run, "_write_tokenizer", full_disk)
    out = tmp_path / "exports" / "hf"
    assert main(["hf", "export", "--workdir", str(trained_run[0]), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {out}: the export stopped (No space left on device); nothing was written; make room, "
                   f"then rerun the same command"], err
    assert list((tmp_path / "exports").iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "exports" / "mine").mkdir()
    (tmp_path / "exports" / "mine" / "config.json").write_text("{}")
    assert main(["hf", "export", "--workdir", str(trained_run[0]), "--out", str(tmp_path / "exports" / "mine")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "exports" / "mine").iterdir()] == ["config.json"]
    assert (tmp_path / "exports" / "mine" / "config.json").read_text() == "{}"


def test_an_import_fine_tunes_with_the_documented_defaults_each_overridable(tmp_path, rng):
    """docs/hf.md's table of an import's defaults is what `hf import` gives a run with nothing set (each differing
    from the from-scratch default the table names beside it), and a `--set` of any of them wins."""
    text = (REPO / "docs" / "hf.md").read_text()
    table = text[text.index("| setting | an import's default | from scratch |"):].split("\n\n")[0]
    rows = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"\| `(\S+)` \| (\S+) \| (\S+) \|", table)}
    assert len(rows) == 5, rows
    hf = pad_vocab(copy_fixture(tmp_path, "llama"), 512)
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "default")]) == 0
    record = json.loads((tmp_path / "default" / "config.json").read_text())
    scratch = json.loads(Config().to_json())
    for name, (ours, from_scratch) in rows.items():
        section, field = name.split(".")
        assert (record[section][field], scratch[section][field]) == (ours, from_scratch), name
    chosen = {"optim.lr": float(rng.uniform(1e-5, 1e-4)), "optim.final_lr": float(rng.uniform(0, 1e-6)),
              "optim.warmup_steps": int(rng.integers(1, 9)), "optim.weight_decay": float(rng.uniform(0.01, 0.2)),
              "data.batch_size": int(rng.integers(1, 5)) * 8}
    assert set(chosen) == set(rows)
    assert main(["hf", "import", str(hf), "--workdir", str(tmp_path / "set"),
                 *sets(f"{k}={v!r}" for k, v in chosen.items())]) == 0
    record = json.loads((tmp_path / "set" / "config.json").read_text())
    assert {k: record[k.split(".")[0]][k.split(".")[1]] for k in chosen} == chosen

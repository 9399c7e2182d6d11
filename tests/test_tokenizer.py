"""Hugging Face tokenizers (data.tokenizer=DIR): ids equal transformers' AutoTokenizer (golden ids from
tests/fixtures/tokenizer/make_fixtures.py; live on fresh random tokenizers where transformers is installed), the
special ids and padding, `prepare`'s worker pool and the pipeline, refusals at load (another tokenizer's shards, an
embedding smaller than the tokenizer, a directory without tokenizer.json), and a run directory's own copy
(RUN/tokenizer/ with SHA256SUMS: relative in config.json, a changed file refused)."""

import dataclasses
import hashlib
import importlib.util
import json
import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY
from test_data import doc_index, segments, write_jsonl

from diffjax import checks, cli
from diffjax import config as config_lib
from diffjax.config import ConfigError, DataConfig
from diffjax.data import pipeline, prepare
from diffjax.data.sources import DataError
from diffjax.data.tokenizer import HFTokenizer, get_tokenizer
from diffjax.train import run_config

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer"
GOLDEN = json.loads((FIXTURE / "golden.json").read_text())
_spec = importlib.util.spec_from_file_location("tokenizer_fixtures", FIXTURE / "make_fixtures.py")
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)  # the fixture's own training and texts (it imports transformers only when run)
SPECIAL, TEXTS, corpus, save, train_bpe = (fixtures.SPECIAL, fixtures.TEXTS, fixtures.corpus, fixtures.save,
                                           fixtures.train_bpe)
LIVE = pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="needs transformers")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def random_tokenizer(rng, directory: Path, **tokens) -> tuple[Path, object]:
    """A BPE tokenizer trained on a fresh random corpus, saved in `directory` (tokens: e.g. eos_token="</s>")."""
    tok = train_bpe(corpus(rng, 200), int(rng.integers(300, 420)))
    return save(tok, directory, **tokens), tok


def mixed_texts(rng, n: int) -> list[str]:
    """Random text of words, random characters (CJK, emoji, accents), runs of spaces, newlines, tabs and
    special-token text."""
    pieces = ["the", "tokenizer", "naïve", "日本語", "😀", "🇫🇷", "\t", "\n", "\n\n", "   ", " ", "<|endoftext|>", "<s>",
              "</s>", "<pad>", "<|endo", "x" * int(rng.integers(1, 30)), "e\u0301", "한국어", "12345", "\r\n"]
    return ["".join(rng.choice(pieces, int(rng.integers(0, 40)))) for _ in range(n)]


def has_special_text(text: str) -> bool:
    return any(s in text for s in SPECIAL)


# ------------------------------------------------------------------------------------- against transformers
def test_encode_gives_autotokenizers_ids():
    """The golden ids: diffjax's are AutoTokenizer's with add_special_tokens=False, split_special_tokens=True, on
    every text; they equal AutoTokenizer's default where the text holds no special-token text, and differ where it
    does (there the default gives the special token's id, diffjax ordinary text pieces)."""
    tok = get_tokenizer(str(FIXTURE))
    assert (tok.bos_id, tok.eos_id, tok.min_vocab_size) == (GOLDEN["bos_id"], GOLDEN["eos_id"], GOLDEN["n_ids"])
    assert GOLDEN["pad_id"] is None and tok.pad_id == GOLDEN["n_ids"]  # no pad token: the first id past them
    specials = {GOLDEN["bos_id"], GOLDEN["eos_id"], *(tok._tok.token_to_id(s) for s in SPECIAL)}
    for case in GOLDEN["texts"]:
        ids = tok.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert case["ids_with_bos"] == [GOLDEN["bos_id"], *case["ids_default"]]  # a BOS that encode never adds
        if has_special_text(case["text"]):
            assert ids != case["ids_default"] and not specials & set(ids), case["text"]
        else:
            assert ids == case["ids_default"], case["text"]
        assert tok.decode(ids) == case["text"]
    assert tok.encode_batch([c["text"] for c in GOLDEN["texts"]]) == [c["ids"] for c in GOLDEN["texts"]]
    assert {c["text"] for c in GOLDEN["texts"]} == set(TEXTS)


@LIVE
def test_a_fresh_random_tokenizer_encodes_as_autotokenizer_does(tmp_path, rng):
    from transformers import AutoTokenizer

    directory, _ = random_tokenizer(rng, tmp_path / "tok", bos_token="<s>", eos_token="</s>")
    ours, auto = get_tokenizer(str(directory)), AutoTokenizer.from_pretrained(directory)
    texts = mixed_texts(rng, 60)
    assert any(map(has_special_text, texts)) and not all(map(has_special_text, texts))
    assert (ours.bos_id, ours.eos_id, ours.min_vocab_size) == (auto.bos_token_id, auto.eos_token_id, len(auto))
    for text, ids in zip(texts, ours.encode_batch(texts), strict=True):
        assert ids == ours.encode(text) == auto(text, add_special_tokens=False, split_special_tokens=True).input_ids
        if not has_special_text(text):
            assert ids == auto(text, add_special_tokens=False).input_ids
        assert ours.decode(ids) == text == auto.decode(ids)


# ---------------------------------------------------------------------------------- special ids and padding
def test_special_ids_and_padding(tmp_path, rng):
    """bos / eos / pad from tokenizer_config.json, else special_tokens_map.json, else the model's config.json; no
    pad token: the first id past the tokenizer's; vocab_size: its ids and pad rounded up to a multiple of 64."""
    directory, trained = random_tokenizer(rng, tmp_path / "a", bos_token="<s>", eos_token="</s>")
    n, token = trained.get_vocab_size(with_added_tokens=True), trained.token_to_id
    tok = get_tokenizer(str(directory))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.min_vocab_size) == (token("<s>"), token("</s>"), n, n)
    assert tok.vocab_size == 64 * math.ceil((n + 1) / 64) and tok.vocab_size % 64 == 0
    save(trained, directory, eos_token="</s>", pad_token="<pad>")  # a pad token of its own; no BOS
    tok = get_tokenizer(str(directory))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (None, token("</s>"), token("<pad>"),
                                                                     64 * math.ceil(n / 64))
    (directory / "tokenizer_config.json").unlink()  # special_tokens_map.json, tokens as {"content": ...}
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert get_tokenizer(str(directory)).eos_id == token("<|endoftext|>")
    (directory / "special_tokens_map.json").unlink()  # a model directory's config.json: several EOS, the first
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [token("</s>"), token("<|endoftext|>")],
                                                       "bos_token_id": token("<s>"), "pad_token_id": None}))
    tok = get_tokenizer(str(directory))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (token("<s>"), token("</s>"), n)
    for config, message in (({}, "no eos_token"), ({"eos_token_id": n + 3}, f"eos_token_id {n + 3} is not an id"),
                            ({"eos_token": "<eos>"}, "eos_token '<eos>' is not a token")):
        name = "tokenizer_config.json" if "eos_token" in config else "config.json"
        (directory / "config.json").unlink(missing_ok=True)
        (directory / name).write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=message):
            get_tokenizer(str(directory))


def test_decode_skips_padding_and_ids_past_the_tokenizer_and_pickles_by_directory(tmp_path, rng):
    directory, trained = random_tokenizer(rng, tmp_path / "tok", eos_token="</s>")
    tok = get_tokenizer(str(directory))
    text = mixed_texts(rng, 1)[0]
    ids = tok.encode(text)
    assert tok.decode([tok.pad_id, *ids, tok.pad_id, tok.vocab_size - 1, 10**6, -1]) == text
    assert tok.decode([*ids, tok.eos_id]) == text + "</s>"  # EOS is kept, as cl100k's decode keeps it
    again = pickle.loads(pickle.dumps(tok))
    assert (again.name, again.identity, again.encode(text)) == (tok.name, tok.identity, ids)


def test_a_bad_tokenizer_spec_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": "nonsense"}')
    for spec, message in ((tmp_path / "empty", f"{tmp_path / 'empty'}: no tokenizer.json in this directory"),
                          ("gpt2", "unknown tokenizer 'gpt2': neither one of"),
                          (FIXTURE / "tokenizer.json", "a file; a Hugging Face tokenizer is named by its directory"),
                          (tmp_path / "broken", "not a tokenizer the tokenizers library reads")):
        with pytest.raises(ConfigError, match=message) as err:
            get_tokenizer(str(spec))
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------- prepare and the pipeline
def test_prepare_and_the_pipeline_with_an_hf_tokenizer(tmp_path, rng):
    """`prepare` over its spawn pool (the tokenizer pickled into 2 workers) writes each document's ids; the pipeline
    reads them with the same tokenizer from another directory (the same tokenizer.json), and refuses them for
    another tokenizer, naming both."""
    directory, _ = random_tokenizer(rng, tmp_path / "tok", eos_token="</s>")
    tok = get_tokenizer(str(directory))
    docs = [d for d in mixed_texts(rng, 80) if d.strip()]  # what a JSONL record keeps
    meta = prepare.prepare(write_jsonl(tmp_path / "d.jsonl", docs), tmp_path / "shards", source="jsonl",
                           tokenizer=str(directory), workers=2, progress=False, log=lambda *a: None, shard_tokens=500)
    assert meta["tokenizer"] == sha256(directory / "tokenizer.json") and len(meta["shards"]) > 1
    assert meta["tokenizer_path"] == str(directory.resolve()) and meta["n_docs"] == len(docs)
    shards = prepare.open_shards(tmp_path / "shards")
    assert [shards[i].tolist() for i in range(len(docs))] == [tok.encode(d) for d in docs]

    moved = Path(shutil.copytree(directory, tmp_path / "elsewhere"))
    cfg = DataConfig(source="shards", path=str(tmp_path / "shards"), tokenizer=str(moved), seq_len=32, batch_size=4,
                     val_fraction=0.1)
    batch = pipeline.make_iterator(cfg, process_index=0, process_count=1).next()
    joined = doc_index(docs, tok)
    for r, s, e in segments(batch):  # each segment: a slice of one document's ids + EOS
        piece = [*batch["tokens"][r, s:e].tolist(), int(batch["targets"][r, e - 1])]
        assert any("," + ",".join(map(str, piece)) + "," in j for j in joined)

    other, _ = random_tokenizer(rng, tmp_path / "other", eos_token="</s>")
    for spec, named in ((str(other), f"{other} (tokenizer.json sha256 {sha256(other / 'tokenizer.json')[:12]}"),
                        ("byte", "data.tokenizer is 'byte'")):
        with pytest.raises(DataError, match="shards were tokenized with") as err:
            pipeline.make_iterator(dataclasses.replace(cfg, tokenizer=spec), process_index=0, process_count=1)
        message = str(err.value)
        assert f"{directory.resolve()} (tokenizer.json sha256 {meta['tokenizer'][:12]}" in message and named in message


def test_an_embedding_smaller_than_the_tokenizer_is_refused(tmp_path, rng):
    directory, trained = random_tokenizer(rng, tmp_path / "tok", eos_token="</s>")
    n = trained.get_vocab_size(with_added_tokens=True)
    tok = get_tokenizer(str(directory))
    base = ["data.source=text", "data.path=corpus.txt", f"data.tokenizer={directory}"]
    assert checks.load(TINY, [*base, f"model.vocab_size={n}"]).data.tokenizer == str(directory)  # pad left out
    with pytest.raises(ConfigError) as err:
        checks.load(TINY, [*base, f"model.vocab_size={n - 1}"])
    assert str(err.value) == (f"model.vocab_size: {n - 1} ids cannot embed the {directory} tokenizer's ids "
                              f"(data.tokenizer={directory} produces ids up to {n - 1}); set model.vocab_size="
                              f"{tok.vocab_size}")


def test_mqar_with_a_tokenizer_whose_end_of_text_id_is_low_is_refused_by_name():
    """MQAR's ids lie between 32 and the end-of-text id; the fixture's is 2 (as many HF tokenizers'): the default task
    mixture is refused naming the task and the way out, and retrieval alone loads."""
    base = [f"data.tokenizer={FIXTURE}", "model.vocab_size=1024"]
    with pytest.raises(ConfigError) as err:
        checks.load(TINY, base)
    assert str(err.value).startswith("data.tasks: MQAR draws its ids between 32 and the end-of-text id, and ")
    assert f"'s is {GOLDEN['eos_id']}: leave mqar out (data.tasks=retrieval)" in str(err.value)
    assert checks.load(TINY, [*base, "data.tasks=retrieval", "data.seq_len=512"]).data.tasks == ("retrieval",)


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_directory_without_tokenizer_json_exits_2_writing_nothing(tmp_path, capsys, command):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (tmp_path / "corpus.txt").write_text("some text\n\nmore text")
    if command == "train":
        args = ["train", "--config", TINY, "--set", f"data.tokenizer={tmp_path / 'tok'}", "--workdir",
                str(tmp_path / "run"), "--no-progress"]
    else:
        args = ["prepare", "--path", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "run"), "--tokenizer",
                str(tmp_path / "tok"), "--workers", "1", "--no-progress"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'tok'}: no tokenizer.json in this directory" in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------- a run's own tokenizer
def hf_config(directory, tokenizer) -> config_lib.Config:
    cfg = config_lib.load(TINY, ["data.source=text", f"data.path={directory}/corpus.txt", "model.vocab_size=512"])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tokenizer)))


def test_a_run_owns_a_copy_of_its_tokenizer(tmp_path, rng):
    """A run's config.json names its copy relatively (the run directory moves); resuming with the original directory
    is no change; another tokenizer is; a changed, removed or added file in the copy is refused."""
    source, _ = random_tokenizer(rng, tmp_path / "src", bos_token="<s>", eos_token="</s>")
    cfg, run = hf_config(tmp_path, source), tmp_path / "run"
    run.mkdir()
    run_config.write(run, cfg)
    copy = run / "tokenizer"
    assert json.loads((run / "config.json").read_text())["data"]["tokenizer"] == "tokenizer"
    assert (copy / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    sums = dict(line.split()[::-1] for line in (copy / "SHA256SUMS").read_text().splitlines())
    assert sums == {p.name: sha256(p) for p in copy.iterdir() if p.name != "SHA256SUMS"}
    assert set(sums) == {"tokenizer.json", "tokenizer_config.json"}

    moved = Path(shutil.move(run, tmp_path / "moved"))
    loaded = run_config.load(moved)
    assert loaded.data.tokenizer == str((moved / "tokenizer").resolve())
    text = mixed_texts(rng, 1)[0]
    assert get_tokenizer(loaded.data.tokenizer).encode(text) == get_tokenizer(str(source)).encode(text)
    run_config.check_resume(moved, cfg)  # the original directory: the same tokenizer
    assert run_config.data_restart(moved, cfg) is None
    other, _ = random_tokenizer(rng, tmp_path / "other", bos_token="<s>", eos_token="</s>")
    with pytest.raises(ConfigError, match="data.tokenizer: .* in the run, .* now"):
        run_config.check_resume(moved, hf_config(tmp_path, other))

    original = (moved / "tokenizer" / "tokenizer.json").read_bytes()
    for change, message in ((lambda p: p.write_bytes(original + b" "), "tokenizer.json: changed since the run "
                                                                       "copied it"),
                            (lambda p: p.unlink(), "no tokenizer.json in this directory \\(its SHA256SUMS records one"),
                            (lambda p: p.with_name("special_tokens_map.json").write_text("{}"),
                             "special_tokens_map.json: not in SHA256SUMS")):
        change(moved / "tokenizer" / "tokenizer.json")
        with pytest.raises(ConfigError, match=message):
            checks.check(run_config.load(moved))
        (moved / "tokenizer" / "special_tokens_map.json").unlink(missing_ok=True)
        (moved / "tokenizer" / "tokenizer.json").write_bytes(original)
    checks.check(run_config.load(moved))


def test_a_copy_keeps_the_special_tokens_of_a_model_directory(tmp_path, rng):
    """A source whose ids come from its config.json (no tokenizer_config.json): the copy's tokenizer_config.json
    names them (and a tokenizer_class), so the copy alone gives the same ids."""
    source, trained = random_tokenizer(rng, tmp_path / "src")
    (source / "config.json").write_text(json.dumps({"bos_token_id": trained.token_to_id("<s>"),
                                                    "eos_token_id": trained.token_to_id("<|endoftext|>")}))
    run = tmp_path / "run"
    run.mkdir()
    run_config.write(run, hf_config(tmp_path, source))
    ours, theirs = HFTokenizer(run / "tokenizer"), HFTokenizer(source)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_id, theirs.eos_id, theirs.pad_id)
    assert json.loads((run / "tokenizer" / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>"}
    assert not (run / "tokenizer" / "config.json").exists()


@pytest.mark.slow  # end to end through the CLI: trains
def test_train_copies_the_tokenizer_into_a_new_run_and_resumes_from_the_original_directory(tmp_path, rng, capsys):
    """`diffjax train --set data.tokenizer=DIR` on a new run: the run holds its copy and config.json names it; the
    same command again (naming DIR) resumes the run unchanged (no new segment); `diffjax eval` reads the copy."""
    source, _ = random_tokenizer(rng, tmp_path / "src", eos_token="</s>")
    (tmp_path / "corpus.txt").write_text("\n\n".join(mixed_texts(rng, 40)))
    overrides = ["model.d_model=32", "model.n_heads=1", "model.head_dim=16", "model.n_layers=2",
                 "model.vocab_size=512", "data.source=text", f"data.path={tmp_path / 'corpus.txt'}",
                 f"data.tokenizer={source}", "data.seq_len=32", "data.batch_size=8", "train.steps=2",
                 "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.telemetry_every=0",
                 "optim.warmup_steps=1"]
    args = ["train", "--config", TINY, *[a for o in overrides for a in ("--set", o)], "--workdir",
            str(tmp_path / "run"), "--no-progress"]
    assert cli.main(args) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["data"]["tokenizer"] == "tokenizer" and "segments" not in stored
    assert sha256(tmp_path / "run" / "tokenizer" / "tokenizer.json") == sha256(source / "tokenizer.json")
    assert cli.main(args) == 0  # resumed at its last step with the original directory: no change
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == stored
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(tmp_path / "run"), "--protocol", "validation", "--json"]) == 0
    assert np.isfinite(json.loads((tmp_path / "run" / "eval" / "validation.json").read_text())["loss"])

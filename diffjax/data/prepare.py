"""`diffjax prepare`: tokenize a corpus (text, JSONL, Parquet, Arrow: diffjax.data.readers) into ArrayRecord shards,
and the reader of that format.

OUT/shard-<hash8>-NNNNN.array_record: one record per document, its token ids as little-endian int32 bytes (no EOS:
the pipeline appends it). OUT/metadata.json, written last: the tokenizer's identity (a registered name, or the sha256
of an HF tokenizer.json), counts, each source's sha256 and the shards' sizes. A rerun with the same `input_hash`
(format version, tokenizer, options, sources) over intact shards does nothing; an interrupted run leaves the previous
output readable (shards renamed into place, then metadata.json replaced, then older shards removed), and a run that
fails on bad input removes the shards it wrote. The sources are read as they are tokenized, at most
IN_FLIGHT batches per worker ahead of the writer, so memory is flat in the size of a file and of the corpus.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from diffjax.data import readers, sources
from diffjax.data.sources import DataError
from diffjax.data.tokenizer import describe, get_tokenizer

FORMAT_VERSION = 1
METADATA = "metadata.json"
CHUNK_CHARS = 1 << 20  # documents are sent to the pool in ~1 MB batches
IN_FLIGHT = 2  # batches per worker read ahead of the writer: enough to keep the workers busy
_REQUIRED = ("format_version", "tokenizer", "vocab_size", "n_docs", "n_tokens", "input_hash", "sources", "shards")


class ShardSource:
    """Random access over the documents of a prepared directory (a Grain data source)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.metadata = read_metadata(self.directory)
        self.tokenizer = self.metadata["tokenizer"]  # its identity
        self.tokenizer_label = describe(self.tokenizer, self.metadata.get("tokenizer_path"))
        self._paths = [str(self.directory / s["file"]) for s in self.metadata["shards"]]
        self._source = None  # opened lazily so the object pickles cheaply into Grain workers

    def __len__(self) -> int:
        return self.metadata["n_docs"]

    def __getitem__(self, i: int) -> np.ndarray:
        if self._source is None:
            import grain

            self._source = grain.sources.ArrayRecordDataSource(self._paths)
        return np.frombuffer(self._source[int(i)], dtype="<i4")

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def __repr__(self) -> str:
        return f"ShardSource({self.directory}, {len(self)} docs, {self.tokenizer})"


def read_metadata(directory: Path) -> dict:
    """metadata.json of a complete preparation, after checking every shard against it."""
    if not directory.is_dir():
        raise DataError(f"{directory}: no such shard directory")
    meta_path = directory / METADATA
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: missing; {directory} is not a complete `diffjax prepare` output "
                        "(interrupted run?) — re-run `diffjax prepare`")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{meta_path}: unreadable metadata ({e})") from e
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise DataError(f"{meta_path}: incomplete metadata, missing {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"{meta_path}: format version {meta['format_version']}, this code reads {FORMAT_VERSION}")
    for shard in meta["shards"]:
        _check_shard(directory / shard["file"], shard)
    if sum(s["n_records"] for s in meta["shards"]) != meta["n_docs"]:
        raise DataError(f"{meta_path}: shard record counts do not add up to n_docs={meta['n_docs']}")
    return meta


def _check_shard(path: Path, expected: dict) -> None:
    if not path.is_file():
        raise DataError(f"{path}: missing, though {path.parent / METADATA} lists it: put the shards back (or rerun "
                        f"`diffjax prepare`), then rerun the same command")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise DataError(f"{path}: {size} bytes, metadata.json records {expected['bytes']} (truncated or replaced)")
    try:
        reader = ArrayRecordReader(str(path))
        n = reader.num_records()
        reader.close()
    except Exception as e:  # array_record raises plain RuntimeError / ValueError on corrupt files
        raise DataError(f"{path}: unreadable ArrayRecord shard ({e})") from e
    if n != expected["n_records"]:
        raise DataError(f"{path}: {n} records, metadata.json records {expected['n_records']}")


def open_shards(directory: str | Path) -> ShardSource:
    return ShardSource(directory)


_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_with_size(item: tuple[list[str], int]) -> tuple[list[bytes], int]:
    docs, size = item
    return [np.asarray(ids, dtype="<i4").tobytes() for ids in _worker_tokenizer.encode_batch(docs)], size


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class _ShardWriter:
    """Rolls over to a new shard every `shard_tokens` tokens; each shard is renamed into place when closed."""

    def __init__(self, out: Path, stem: str, shard_tokens: int):
        self.out, self.stem, self.shard_tokens = out, stem, shard_tokens
        self.shards: list[dict] = []
        self._writer = None

    def write(self, record: bytes) -> None:
        if self._writer is None:
            name = f"{self.stem}-{len(self.shards):05d}.array_record"
            self._tmp = self.out / f".{name}.tmp"
            self._writer = ArrayRecordWriter(str(self._tmp), "group_size:1")
            self.shards.append({"file": name, "n_records": 0, "n_tokens": 0, "bytes": 0})
        self._writer.write(record)
        self.shards[-1]["n_records"] += 1
        self.shards[-1]["n_tokens"] += len(record) // 4
        if self.shards[-1]["n_tokens"] >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            final = self.out / self.shards[-1]["file"]
            os.replace(self._tmp, final)
            self.shards[-1]["bytes"] = final.stat().st_size

    def abort(self) -> None:
        """Remove what this run wrote: no shard of a failed run is left to look like output."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._tmp.unlink(missing_ok=True)
            self.shards.pop()
        for shard in self.shards:
            (self.out / shard["file"]).unlink(missing_ok=True)


def prepare(path: str | Path, out: str | Path, *, source: str = "auto", tokenizer: str = "byte",
            text_field: str = "text", text_split: str = "paragraph", workers: int | None = None,
            shard_tokens: int = 1 << 26, progress: bool = True, log=print, seq_len: int = 2048) -> dict:
    """Tokenize `path` into shards under `out` with `tokenizer` (a registered name or an HF tokenizer directory);
    returns the metadata (a no-op if `out` is already up to date). `source` "auto": the format the file suffixes
    say (logged). `seq_len`: the training length the documents are compared with (`describe_documents`)."""
    tok = get_tokenizer(tokenizer)  # a bad name or directory: a ConfigError before anything is read or written
    root, out = Path(path), Path(out)
    if source == "auto":
        source, detected = sources.detect(root)
        log(detected)
    files = sources.list_files(root, source)
    base = root if root.is_dir() else root.parent
    file_info = [{"path": str(f.relative_to(base)), "sha256": _file_sha256(f), "bytes": f.stat().st_size}
                 for f in files]
    options = {"tokenizer": tok.identity, "source": source, "text_field": text_field, "text_split": text_split}
    blob = json.dumps({"format_version": FORMAT_VERSION, **options, "sources": file_info}, sort_keys=True)
    input_hash = hashlib.sha256(blob.encode()).hexdigest()
    if (out / METADATA).is_file():
        try:
            old = read_metadata(out)
        except DataError as e:
            log(f"{out}: existing output is not usable ({e}); preparing again")
        else:
            if old["input_hash"] == input_hash:
                log(f"{out}: up to date ({old['n_docs']} documents, {old['n_tokens']} tokens); nothing to do")
                return old
    out.mkdir(parents=True, exist_ok=True)

    counts = readers.Counts()
    total_bytes = sum(f["bytes"] for f in file_info)

    def chunks():
        """(documents, bytes of input they stand for) in ~1 MB batches, file by file, in order."""
        for f, info in zip(files, file_info, strict=True):
            batch, chars, done = [], 0, 0
            for doc, position in readers.documents(f, source, counts, text_field=text_field, text_split=text_split):
                batch.append(doc)
                chars += len(doc)
                if chars >= CHUNK_CHARS:
                    yield batch, position - done
                    batch, chars, done = [], 0, position
            yield batch, info["bytes"] - done

    writer = _ShardWriter(out, f"shard-{input_hash[:8]}", shard_tokens)
    n_docs = n_tokens = 0
    workers = workers or os.cpu_count() or 1
    try:
        with _progress(progress, total_bytes, f"tokenize {tok.name}") as advance, _pool(workers, tok) as imap:
            for records, size in imap(_encode_with_size, chunks()):
                for record in records:
                    if len(record) == 0:  # a document with no tokens cannot be trained on
                        counts.skipped_empty += 1
                        continue
                    writer.write(record)
                    n_docs += 1
                    n_tokens += len(record) // 4
                advance(size)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if n_docs == 0:
        raise DataError(f"{root}: empty corpus: no non-empty documents in {len(files)} file(s)")

    read_from = {"tokenizer_path": str(Path(tokenizer).resolve())} if tok.identity != tokenizer else {}  # HF: its dir
    stats = {"skipped_empty": counts.skipped_empty, "replaced_bytes": counts.replaced_bytes}
    meta = {"format_version": FORMAT_VERSION, **options, **read_from, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "n_docs": n_docs, "n_tokens": n_tokens, **stats, "input_hash": input_hash,
            "sources": file_info, "shards": writer.shards}
    tmp = out / f".{METADATA}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / METADATA)
    keep = {s["file"] for s in writer.shards}
    for old_shard in out.glob("shard-*.array_record"):
        if old_shard.name not in keep:
            old_shard.unlink()
    log(f"{out}: {n_docs} documents, {n_tokens} tokens in {len(writer.shards)} shard(s) "
        f"({stats['skipped_empty']} empty skipped, {stats['replaced_bytes']} bad byte sequences replaced)")
    for line in describe_documents(meta, seq_len):
        log(line)
    return meta


@contextlib.contextmanager
def _pool(workers: int, tokenizer):
    """An ordered, lazy `imap` over a spawn pool (fork is unsafe once JAX threads exist), or in-process for 1 worker;
    `tokenizer` is pickled into each worker (a registered one by name, an HF one by its directory)."""
    if workers <= 1:
        _init_worker(tokenizer)
        yield map
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:

        def imap(fn, items):
            # Pool.imap would read all of `items` ahead into its task queue: the whole corpus in memory.
            pending = collections.deque()
            for item in items:
                pending.append(pool.apply_async(fn, (item,)))
                if len(pending) >= IN_FLIGHT * workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()

        yield imap


@contextlib.contextmanager
def _progress(enabled: bool, total: int, description: str):
    """A rich progress bar over input bytes; yields `advance(n_bytes)`."""
    if not enabled:
        yield lambda n: None
        return
    from rich import progress as rp

    columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(), rp.TransferSpeedColumn(),
               rp.TimeRemainingColumn())
    with rp.Progress(*columns) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


SHORT = 4  # a mean document under 1/SHORT of the training length is "far shorter"


def describe_documents(meta: dict, seq_len: int) -> list[str]:
    """What one document of these shards is, and a warning when the mean document is far shorter than `seq_len`:
    attention never crosses documents, so such a run trains on contexts about a document long (docs/data.md)."""
    split = {"paragraph": "text between blank lines (--text-split paragraph)",
             "file": "one per file (--text-split file)"}[meta["text_split"]]
    what = split if meta["source"] == "text" else f"one per JSONL record (its {meta['text_field']!r} field)"
    mean = meta["n_tokens"] / meta["n_docs"]
    lines = [f"documents: {what}; {mean:,.0f} tokens each on average"]
    if mean * SHORT < seq_len:
        hint = (": for books or other long texts, one per file, --text-split file"
                if meta["source"] == "text" and meta["text_split"] == "paragraph" else "")
        lines.append(f"warning: the mean document ({mean:,.0f} tokens) is under a quarter of the {seq_len}-token "
                     f"training length (--seq-len); attention never crosses documents, so the model learns from "
                     f"contexts about {mean:,.0f} tokens long{hint}")
    return lines

"""Incremental readers of one corpus file: its documents one at a time, so memory is flat in the file's size.

- text: read line by line; `text_split="paragraph"` makes each run of lines between blank (whitespace-only) lines a
  document, stripped, "file" the whole file (one document);
- jsonl: one document per line, the string in `text_field`;
- parquet: the `text_field` column, row group by row group, BATCH_ROWS rows decoded at a time;
- arrow: an Arrow IPC stream (the data-*.arrow files of `datasets.save_to_disk`) or file, record batch by record
  batch.

Text and JSONL files ending in .gz / .zst are decompressed as they are read (pyarrow, which finds a truncated
stream: the `zstandard` package's stream reader ends there silently). Undecodable bytes are replaced by U+FFFD and
counted (one DataWarning per file), but a Parquet, Arrow or compressed file under text or jsonl (known by its first
bytes, MAGIC) is refused; whitespace-only documents are skipped and counted. A document is held whole
while it is tokenized, so one longer than MAX_DOCUMENT_BYTES is refused: it is what bounds the memory.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

from diffjax.data.errors import DataError, DataWarning

FORMATS = ("text", "jsonl", "parquet", "arrow")
TEXT_SPLITS = ("paragraph", "file")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # pyarrow's codec names
BLOCK = 1 << 20  # bytes buffered per read
BATCH_ROWS = 512  # Parquet rows decoded at a time: a batch of long documents stays a few MB
MAX_DOCUMENT_BYTES = 16 << 20
_BLANK = " \t\r\f\v"  # a line of only these separates paragraphs
_REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = _REPLACEMENT.encode()


@dataclasses.dataclass
class Counts:
    skipped_empty: int = 0  # empty / whitespace-only documents dropped
    replaced_bytes: int = 0  # undecodable byte sequences replaced by U+FFFD


def documents(file: Path, source: str, counts: Counts, *, text_field: str = "text",
              text_split: str = "paragraph") -> Iterator[tuple[str, int]]:
    """(document, bytes of `file` read so far) for each non-empty document of `file`, in order; empty ones are
    counted in `counts`, and so are undecodable bytes (with a DataWarning once the file is read)."""
    if source == "text":
        if text_split not in TEXT_SPLITS:
            raise DataError(f"unknown text_split {text_split!r}; choose one of {TEXT_SPLITS}")
        _refuse_binary(file, source)
        docs = _paragraphs(file, counts) if text_split == "paragraph" else _whole_file(file, counts)
    elif source == "jsonl":
        _refuse_binary(file, source)
        docs = _jsonl(file, text_field, counts)
    elif source in ("parquet", "arrow"):
        docs = _table(file, source, text_field)
    else:
        raise DataError(f"unknown source {source!r}; choose one of {FORMATS}")
    bad_before = counts.replaced_bytes
    for doc, position in docs:
        if doc.strip():
            yield doc, position
        else:
            counts.skipped_empty += 1
    if counts.replaced_bytes > bad_before:
        warnings.warn(f"{file}: {counts.replaced_bytes - bad_before} undecodable byte sequence(s) replaced with "
                      "U+FFFD", DataWarning, stacklevel=2)


# Files that the text and JSONL readers would decode as text (bad bytes replaced, a warning, exit 0): what their
# first bytes, after the decompression their suffix asks for, say they are, and what reads them.
MAGIC = ((b"PAR1", "a Parquet file", "tokenize it with `diffjax prepare --source parquet`"),
         (b"ARROW1", "an Arrow IPC file", "tokenize it with `diffjax prepare --source arrow`"),
         (b"\xff\xff\xff\xff", "an Arrow IPC stream", "tokenize it with `diffjax prepare --source arrow`"),
         (b"\x1f\x8b", "gzip-compressed", "name it {name}.gz (text and JSONL files so named are read decompressed)"),
         (b"\x28\xb5\x2f\xfd", "zstd-compressed", "name it {name}.zst (text and JSONL files so named are read "
                                                 "decompressed)"))


def _refuse_binary(file: Path, source: str) -> None:
    """A DataError when `file` is a table or compressed data that `source` (text, jsonl) would read as text."""
    stream, _ = _open(file)
    try:
        with stream:
            head = stream.read(8)
    except (OSError, ValueError):
        return  # a corrupt compressed stream: the reader names it where it fails
    for magic, what, fix in MAGIC:
        if head.startswith(magic):
            kind = "text" if source == "text" else "JSONL"
            raise DataError(f"{file}: {what} (it starts with {magic.hex(' ')}), not {kind}; "
                            f"{fix.format(name=file.name)}")


def decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 with U+FFFD for bad bytes, and how many were replaced (a literal U+FFFD in the input is not counted)."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT_BYTES)


def json_record(line: str, file: Path, lineno: int) -> dict | None:
    """The object of one JSONL line (None for a blank line); a bad line is a DataError naming it."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{file}:{lineno}: invalid JSON ({e.msg})") from e
    if not isinstance(record, dict):
        raise DataError(f"{file}:{lineno}: expected a JSON object, got {type(record).__name__}")
    return record


def _open(file: Path):
    """(a buffered binary stream of `file`'s content, a function giving the bytes of the file read so far)."""
    codec = COMPRESSIONS.get(file.suffix)
    try:
        if codec is None:
            stream = open(file, "rb", buffering=BLOCK)
            return stream, stream.tell
        import pyarrow as pa

        raw = pa.OSFile(str(file))
        return io.BufferedReader(pa.CompressedInputStream(raw, codec), BLOCK), raw.tell
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror or e})") from e


def _lines(file: Path, counts: Counts) -> Iterator[tuple[int, str, bool, int]]:
    """(line number, decoded line without its "\\n", whether one ended it, bytes read so far) for each line, read
    in bounded pieces: a line longer than MAX_DOCUMENT_BYTES is a DataError."""
    stream, position = _open(file)
    read = told = here = 0
    with stream:
        for lineno in itertools.count(1):
            try:
                raw = stream.readline(MAX_DOCUMENT_BYTES + 1)
            except (OSError, ValueError) as e:  # a truncated or corrupt compressed stream, a failing disk
                where = f"line {lineno} (byte {position()} of {file.stat().st_size})"
                raise _unreadable(file, where, e) from e
            if not raw:
                return
            ended = raw.endswith(b"\n")
            if len(raw) > MAX_DOCUMENT_BYTES and not ended:
                raise DataError(f"{file}:{lineno}: a line longer than {MAX_DOCUMENT_BYTES >> 20} MiB (documents are "
                                "tokenized whole): split the document")
            text, n_bad = decode(raw[:-1] if ended else raw)
            counts.replaced_bytes += n_bad
            read += len(raw)
            if read - told >= BLOCK or not told:  # tell() is a system call: once a block is enough for progress
                here, told = position(), read
            yield lineno, text, ended, here


def _paragraphs(file: Path, counts: Counts) -> Iterator[tuple[str, int]]:
    """A paragraph ends at a blank line that a newline ends (so a file's whitespace-only last line is not a break);
    CRLF is read as LF. A file with no paragraph yields one empty document (counted as skipped)."""
    lines, size, any_paragraph, position = [], 0, False, 0
    for lineno, line, ended, position in _lines(file, counts):
        line = line[:-1] if ended and line.endswith("\r") else line
        if ended and not line.strip(_BLANK):
            if paragraph := "\n".join(lines).strip():
                any_paragraph = True
                yield paragraph, position
            lines, size = [], 0
            continue
        lines.append(line)
        size += len(line)
        if size > MAX_DOCUMENT_BYTES:
            raise DataError(f"{file}:{lineno}: a paragraph longer than {MAX_DOCUMENT_BYTES >> 20} MiB of text "
                            "(documents are tokenized whole): separate its paragraphs with blank lines")
    if paragraph := "\n".join(lines).strip():
        any_paragraph = True
        yield paragraph, position
    if not any_paragraph:
        yield "", position


def _whole_file(file: Path, counts: Counts) -> Iterator[tuple[str, int]]:
    stream, position = _open(file)
    with stream:
        try:
            raw = stream.read(MAX_DOCUMENT_BYTES + 1)
        except (OSError, ValueError) as e:
            raise _unreadable(file, f"byte {position()} of {file.stat().st_size}", e) from e
        if len(raw) > MAX_DOCUMENT_BYTES:
            raise DataError(f"{file}: longer than {MAX_DOCUMENT_BYTES >> 20} MiB, and text_split=file makes it one "
                            "document (documents are tokenized whole): use text_split=paragraph")
        text, n_bad = decode(raw)
        counts.replaced_bytes += n_bad
        yield text.strip(), position()  # CRLF kept: the whole file as it is


def _jsonl(file: Path, text_field: str, counts: Counts) -> Iterator[tuple[str, int]]:
    for lineno, line, _, position in _lines(file, counts):
        record = json_record(line, file, lineno)
        if record is None:
            continue
        if text_field not in record:
            raise DataError(f"{file}:{lineno}: no field {text_field!r} in the record")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{file}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string")
        yield value, position


def _table(file: Path, source: str, text_field: str) -> Iterator[tuple[str, int]]:
    """A Parquet file's or an Arrow IPC stream's `text_field` column, batch by batch (neither memory-mapped: RSS
    stays a batch)."""
    row = 0
    for batch, position in (_parquet_batches if source == "parquet" else _arrow_batches)(file, text_field):
        column = batch.column(0)
        if column.null_count:
            first = column.is_null().to_pylist().index(True)
            raise DataError(f"{file}: row {row + first}: {text_field!r} is null, not a string")
        for doc in column.to_pylist():
            yield doc, position
        row += len(column)


def _unreadable(file: Path, where: str, error: Exception) -> DataError:
    return DataError(f"{file}: unreadable at {where} ({' '.join(str(error).split())})")


def _check_column(file: Path, schema, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(f"{file}: no column {text_field!r} (columns: {', '.join(schema.names)}); choose one with "
                        "--text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{file}: column {text_field!r} is {kind}, not a string")


def _parquet_batches(file: Path, text_field: str):
    """(record batch of the one column, bytes of the file read so far, pro rata of its rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # buffered column reads, not a whole row group at once; page checksums checked where the writer wrote them
        pf = pq.ParquetFile(str(file), buffer_size=BLOCK, pre_buffer=False, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{file}: not a readable Parquet file ({' '.join(str(e).split())})") from e
    _check_column(file, pf.schema_arrow, text_field)
    size, n_rows, done = file.stat().st_size, max(pf.metadata.num_rows, 1), 0
    for group in range(pf.num_row_groups):
        try:
            for batch in pf.iter_batches(BATCH_ROWS, row_groups=[group], columns=[text_field], use_threads=False):
                done += len(batch)
                yield batch, size * done // n_rows
        except (OSError, pa.ArrowException) as e:  # a corrupt page, a bad compressed block, a wrong checksum
            raise _unreadable(file, f"row group {group} (after row {done})", e) from e


def _arrow_batches(file: Path, text_field: str):
    """(record batch of the one column, bytes of the file read so far)."""
    import pyarrow as pa

    with pa.OSFile(str(file)) as raw:
        try:
            if raw.read(6) == b"ARROW1":  # the IPC file format (pyarrow.ipc.new_file), not save_to_disk's stream
                raw.seek(0)
                reader = pa.ipc.open_file(raw)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                raw.seek(0)
                reader = batches = pa.ipc.open_stream(raw)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{file}: not an Arrow IPC stream (as `datasets.save_to_disk` writes) or file "
                            f"({' '.join(str(e).split())})") from e
        _check_column(file, reader.schema, text_field)
        column, done = reader.schema.get_field_index(text_field), 0
        try:
            for batch in batches:
                done += len(batch)
                yield batch.select([column]), raw.tell()
        except (OSError, pa.ArrowException) as e:  # a truncated or corrupt stream
            raise _unreadable(file, f"row {done}, near byte {raw.tell()} of {file.stat().st_size}", e) from e

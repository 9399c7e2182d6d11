"""Reading raw corpora into documents: a text file, a directory of files (recursive), or JSONL.

`text_split`: "paragraph" (default) makes each run of text between blank (whitespace-only) lines a document,
stripped; "file" makes each file one. JSONL: one document per line, the string in `text_field`. Undecodable bytes
are replaced by U+FFFD, counted and reported with one DataWarning per file; empty documents are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from pathlib import Path

SOURCES = ("text", "jsonl")
TEXT_SPLITS = ("paragraph", "file")
JSONL_SUFFIXES = (".jsonl", ".json")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*(?:\n[ \t\r\f\v]*)+")
_REPLACEMENT = "\ufffd"


class DataError(ValueError):
    """Unusable input data; the message names the file and the problem."""


class DataWarning(UserWarning):
    """Input data was repaired (undecodable bytes replaced) or partly skipped."""


@dataclasses.dataclass
class Corpus:
    documents: list[str]
    files: list[Path]
    skipped_empty: int = 0  # empty / whitespace-only documents dropped
    replaced_bytes: int = 0  # undecodable byte sequences replaced by U+FFFD


def list_files(path: str | Path, source: str) -> list[Path]:
    """The input files under `path` in a deterministic (sorted) order; hidden files and dirs are ignored."""
    if source not in SOURCES:
        raise DataError(f"unknown raw source {source!r}; choose one of {SOURCES}")
    root = Path(path)
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{root}: neither a regular file nor a directory")
    files = [p for p in sorted(root.rglob("*")) if not any(part.startswith(".") for part in p.relative_to(root).parts)
             and p.is_file() and (source != "jsonl" or p.suffix in JSONL_SUFFIXES)]
    if not files:
        kind = "JSONL (*.jsonl, *.json)" if source == "jsonl" else "readable"
        raise DataError(f"{root}: directory holds no {kind} files")
    return files


def decode_bytes(raw: bytes, name: str | Path) -> tuple[str, int]:
    """UTF-8 decode with U+FFFD for bad bytes; one DataWarning naming the file and the count."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    n_bad = text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode("utf-8"))
    warnings.warn(f"{name}: {n_bad} undecodable byte sequence(s) replaced with U+FFFD", DataWarning, stacklevel=2)
    return text, n_bad


def read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror or e})") from e


def split_text(text: str, text_split: str) -> list[str]:
    if text_split == "file":
        return [text.strip()]
    if text_split == "paragraph":
        # Whitespace between paragraphs is not a document: only empty files / records count as skipped.
        return [p.strip() for p in _BLANK_LINES.split(text.replace("\r\n", "\n")) if p.strip()] or [""]
    raise DataError(f"unknown text_split {text_split!r}; choose one of {TEXT_SPLITS}")


def jsonl_records(text: str, file: Path):
    """(line number, object) for each non-blank line of a JSONL text; a bad line is a DataError naming it."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise DataError(f"{file}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record


def parse_jsonl(text: str, file: Path, text_field: str) -> list[str]:
    docs = []
    for lineno, record in jsonl_records(text, file):
        if text_field not in record:
            raise DataError(f"{file}:{lineno}: no field {text_field!r} in the record")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{file}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string")
        docs.append(value)
    return docs


def file_documents(file: Path, raw: bytes, source: str, *, text_field: str = "text",
                   text_split: str = "paragraph") -> tuple[list[str], int, int]:
    """(non-empty documents, number of empty documents skipped, replaced byte count) of one file's bytes."""
    text, n_bad = decode_bytes(raw, file)
    docs = parse_jsonl(text, file, text_field) if source == "jsonl" else split_text(text, text_split)
    kept = [d for d in docs if d.strip()]
    return kept, len(docs) - len(kept), n_bad


def load_corpus(path: str | Path, source: str, *, text_field: str = "text", text_split: str = "paragraph") -> Corpus:
    """All documents under `path`, in file order then document order."""
    files = list_files(path, source)
    corpus = Corpus(documents=[], files=files)
    for file in files:
        docs, skipped, n_bad = file_documents(file, read_bytes(file), source, text_field=text_field,
                                              text_split=text_split)
        corpus.documents.extend(docs)
        corpus.skipped_empty += skipped
        corpus.replaced_bytes += n_bad
    if not corpus.documents:
        raise DataError(f"{path}: empty corpus: no non-empty documents in {len(files)} file(s)"
                        + (f" ({corpus.skipped_empty} empty document(s) skipped)" if corpus.skipped_empty else ""))
    if corpus.skipped_empty:
        warnings.warn(f"{path}: skipped {corpus.skipped_empty} empty document(s)", DataWarning, stacklevel=2)
    return corpus


def sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()

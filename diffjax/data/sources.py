"""Raw corpora: which files a path holds and in which format, and the on-the-fly sources' documents in memory.

A path is a file or a directory (read recursively, sorted; hidden files and directories are ignored). Formats
(`diffjax.data.readers`): text, JSONL (.jsonl / .json, either gzip- or zstd-compressed: + .gz / .zst), Parquet
(.parquet) and Arrow (.arrow: a `datasets.save_to_disk` directory). `diffjax prepare` streams them; the on-the-fly
sources (`data.source=text|jsonl`) hold the documents in memory, so they refuse a corpus of more than
ON_THE_FLY_MAX_CHARS characters of text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from pathlib import Path

from diffjax.data import readers
from diffjax.data.errors import DataError, DataWarning
from diffjax.data.readers import TEXT_SPLITS, decode, json_record

__all__ = ["DataError", "DataWarning", "TEXT_SPLITS"]
SOURCES = ("text", "jsonl")  # what data.source reads on the fly
DETECTED = ("arrow", "parquet", "jsonl")  # in this order: a save_to_disk directory also holds .json files
SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "arrow": (".arrow",)}
JSONL_SUFFIXES = SUFFIXES["jsonl"]
ON_THE_FLY_MAX_CHARS = 1 << 30  # ~1.7 GB of documents (1.6 bytes a character): docs/data.md, "Corpora as they ship"


@dataclasses.dataclass
class Corpus:
    documents: list[str]
    files: list[Path]
    skipped_empty: int = 0  # empty / whitespace-only documents dropped
    replaced_bytes: int = 0  # undecodable byte sequences replaced by U+FFFD


def format_of(file: Path) -> str:
    """The format a file's name says (after a .gz / .zst), text where it says none of the others."""
    suffixes = file.suffixes[-2:] if file.suffix in readers.COMPRESSIONS else file.suffixes[-1:]
    return next((f for f, ends in SUFFIXES.items() if suffixes and suffixes[0] in ends), "text")


def _walk(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)]


def detect(path: str | Path) -> tuple[str, str]:
    """(the format of `path`, from the suffixes of its files, a line saying so): a directory's is the first of
    DETECTED it holds files of, else text."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    files = [root] if root.is_file() else _walk(root) if root.is_dir() else []
    found = {format_of(f) for f in files}
    source = next((f for f in DETECTED if f in found), "text")
    others = sum(format_of(f) != source for f in files)
    skipped = f"; {others} other file(s) not read (--source to choose)" if others and source != "text" else ""
    return source, f"{root}: reading {source} (detected from the file suffixes{skipped})"


def list_files(path: str | Path, source: str) -> list[Path]:
    """The input files of `source`'s format under `path` in a deterministic (sorted) order. A directory's text
    files are all its files; the other formats', those their suffixes name."""
    if source not in readers.FORMATS:
        raise DataError(f"unknown raw source {source!r}; choose one of {readers.FORMATS}")
    root = Path(path)
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{root}: neither a regular file nor a directory")
    if source == "arrow" and (root / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: its splits
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{root}: a DatasetDict of splits {', '.join(splits)}; point the path at one split's "
                        f"directory (e.g. {root / (splits or ['train'])[0]})")
    files = [f for f in _walk(root) if source == "text" or format_of(f) == source]
    if not files:
        kind = {"jsonl": "JSONL (*.jsonl, *.json, also .gz / .zst)", "parquet": "Parquet (*.parquet)",
                "arrow": "Arrow (*.arrow)", "text": "readable"}[source]
        raise DataError(f"{root}: directory holds no {kind} files")
    return files


def decode_bytes(raw: bytes, name: str | Path) -> tuple[str, int]:
    """UTF-8 decode with U+FFFD for bad bytes; one DataWarning naming the file and the count."""
    text, n_bad = decode(raw)
    if n_bad:
        warnings.warn(f"{name}: {n_bad} undecodable byte sequence(s) replaced with U+FFFD", DataWarning,
                      stacklevel=2)
    return text, n_bad


def read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror or e})") from e


def jsonl_records(text: str, file: Path):
    """(line number, object) for each non-blank line of a JSONL text; a bad line is a DataError naming it."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if (record := json_record(line, file, lineno)) is not None:
            yield lineno, record


def load_corpus(path: str | Path, source: str, *, text_field: str = "text", text_split: str = "paragraph") -> Corpus:
    """All documents under `path`, in file order then document order; more than ON_THE_FLY_MAX_CHARS characters of
    them is a DataError that says to `diffjax prepare` the corpus."""
    files = list_files(path, source)
    corpus, counts, size = Corpus(documents=[], files=files), readers.Counts(), 0
    for file in files:
        for doc, _ in readers.documents(file, source, counts, text_field=text_field, text_split=text_split):
            size += len(doc)
            if size > ON_THE_FLY_MAX_CHARS:
                raise DataError(f"{path}: more than {ON_THE_FLY_MAX_CHARS:,} characters of text, too much to hold in "
                                f"memory (data.source={source} does): tokenize it once with `diffjax prepare "
                                f"--path {path} --out DIR`, then train with data.source=shards data.path=DIR")
            corpus.documents.append(doc)
    corpus.skipped_empty, corpus.replaced_bytes = counts.skipped_empty, counts.replaced_bytes
    if not corpus.documents:
        raise DataError(f"{path}: empty corpus: no non-empty documents in {len(files)} file(s)"
                        + (f" ({corpus.skipped_empty} empty document(s) skipped)" if corpus.skipped_empty else ""))
    if corpus.skipped_empty:
        warnings.warn(f"{path}: skipped {corpus.skipped_empty} empty document(s)", DataWarning, stacklevel=2)
    return corpus


def sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()

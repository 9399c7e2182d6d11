"""Classification datasets for in-context learning (paper §3.5): the JSONL reader, and a synthetic task.

A dataset is a JSONL file of `{"text": str, "label": str | int}` records (TREC, TREC-fine, Banking-77 and Clinic-150
exported with those two fields). The synthetic task (deterministic in `seed`): a few random filler words with one
keyword of its class inserted, e.g. "stone under river lemon across" → "food", so only reading the text gets it right.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from diffjax.data.sources import DataError, decode_bytes, jsonl_records, read_bytes

KEYWORDS = {  # class name -> its keywords (disjoint from each other and from FILLER)
    "animal": ("horse", "tiger", "rabbit", "eagle"),
    "color": ("crimson", "violet", "amber", "teal"),
    "food": ("lemon", "bread", "cheese", "rice"),
    "tool": ("hammer", "wrench", "chisel", "saw"),
    "weather": ("storm", "drizzle", "fog", "hail"),
    "music": ("violin", "drum", "flute", "piano"),
    "sport": ("tennis", "rugby", "hockey", "golf"),
    "body": ("elbow", "ankle", "knee", "wrist"),
}
FILLER = ("stone", "under", "river", "across", "paper", "quiet", "window", "seven", "garden", "slowly",
          "bright", "table", "corner", "later", "simple", "north", "letter", "often", "middle", "cloud")
SALT = 0xC1A5


def synthetic_examples(n: int, seed: int = 0, *, n_classes: int = 4, words: tuple[int, int] = (3, 6)) -> list[dict]:
    """`n` records {"text", "label"} over the first `n_classes` classes of KEYWORDS (labels uniform); each text
    has `words[0]`..`words[1]` filler words plus one keyword of its class."""
    if not 2 <= n_classes <= len(KEYWORDS):
        raise DataError(f"synthetic classification: n_classes must lie in [2, {len(KEYWORDS)}], got {n_classes}")
    if n < 1 or not 0 <= words[0] <= words[1]:
        raise DataError(f"synthetic classification: need n >= 1 and 0 <= words[0] <= words[1], got {n}, {words}")
    rng = np.random.default_rng([seed, SALT])
    labels = list(KEYWORDS)[:n_classes]
    out = []
    for _ in range(n):
        label = labels[rng.integers(n_classes)]
        text = [FILLER[i] for i in rng.integers(len(FILLER), size=rng.integers(words[0], words[1] + 1))]
        text.insert(int(rng.integers(len(text) + 1)), KEYWORDS[label][rng.integers(len(KEYWORDS[label]))])
        out.append({"text": " ".join(text), "label": label})
    return out


def write_synthetic(path: str | Path, n: int, seed: int = 0, *, n_classes: int = 4) -> Path:
    """Write `synthetic_examples(n, seed, n_classes=...)` as JSONL to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_examples(n, seed, n_classes=n_classes)))
    return path


def load(path: str | Path, *, text_field: str = "text", label_field: str = "label") -> list[dict]:
    """The records of a classification JSONL file as [{"text": str, "label": str}] (integer labels as text)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such classification file (JSONL with {text_field!r} and {label_field!r})")
    text, _ = decode_bytes(read_bytes(path), path)
    records = []
    for lineno, record in jsonl_records(text, path):
        for field, kinds in ((text_field, (str,)), (label_field, (str, int))):
            if field not in record:
                raise DataError(f"{path}:{lineno}: no field {field!r} in the record")
            if not isinstance(record[field], kinds) or isinstance(record[field], bool):
                raise DataError(f"{path}:{lineno}: field {field!r} is {type(record[field]).__name__}, "
                                f"not {' or '.join(k.__name__ for k in kinds)}")
        label = str(record[label_field])
        if not label.strip():
            raise DataError(f"{path}:{lineno}: field {label_field!r} is empty")
        records.append({"text": record[text_field], "label": label})
    if not records:
        raise DataError(f"{path}: no records")
    return records

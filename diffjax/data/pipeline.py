"""The Grain input pipeline: documents -> shuffled, packed, per-process batches with a JSON-able state.

    it = make_iterator(cfg.data, split="train")
    batch = it.next()          # dict of NumPy arrays, each [batch_size // process_count, seq_len]
    it2 = make_iterator(cfg.data); it2.set_state(it.get_state())   # continues exactly where `it` was

Splitting, shuffling, packing and the batch keys: docs/design.md §5, "Pipeline".
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from diffjax.data import prepare, sources, synthetic
from diffjax.data.sources import DataError
from diffjax.data.tokenizer import get_tokenizer

SOURCES = ("synthetic", *sources.SOURCES, "shards")  # the values of data.source
BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
SPLITS = ("train", "val")


class _Subset:
    """Random-access view of `source` at `indices` (the split / process share of the documents)."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        try:
            return self.source[int(self.indices[i])]
        except (OSError, RuntimeError) as e:  # array_record's reader raises RuntimeError("open() failed: ...")
            if isinstance(self.source, prepare.ShardSource):
                raise _unreadable_shard(self.source, e) from e
            raise


def _to_pair(tokenizer, doc) -> dict[str, np.ndarray]:
    """A document (text or token ids) + EOS -> {"tokens": ids[:-1], "targets": ids[1:]}."""
    ids = np.asarray(tokenizer.encode(doc) if isinstance(doc, str) else doc, np.int32)
    ids = np.append(ids, np.int32(tokenizer.eos_id))
    return {"tokens": ids[:-1], "targets": ids[1:]}


def _finalize(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = packed["tokens_segment_ids"]
    return {"tokens": packed["tokens"], "targets": packed["targets"], "loss_mask": (segment_ids > 0).astype(np.float32),
            "segment_ids": segment_ids, "positions": packed["tokens_positions"]}


def split_indices(n_docs: int, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """A seeded permutation: its first ceil(n·val_fraction) documents are validation, the rest training."""
    n_val = math.ceil(n_docs * val_fraction)
    if n_val >= n_docs:
        raise DataError(f"{n_docs} document(s) cannot be split with val_fraction={val_fraction}: "
                        "no training documents would remain")
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n_docs)
    return {"val": np.sort(perm[:n_val]), "train": np.sort(perm[n_val:])}


def _process_info(process_index, process_count) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside [0, {process_count})")
    return process_index, process_count


def documents(data_cfg, tokenizer, split: str | None = None):
    """The random-access documents of a text / jsonl / shards config: one split's (`split_indices`), or all."""
    if not Path(data_cfg.path).exists():  # e.g. a run directory's data, moved since
        raise DataError(f"data.path {data_cfg.path}: no such file or directory; set data.path to where the data is "
                        f"now")
    if data_cfg.source == "shards":
        docs = prepare.open_shards(data_cfg.path)
        if docs.tokenizer != tokenizer.identity:  # a registered name, or an HF tokenizer.json's hash
            raise DataError(f"{data_cfg.path}: shards were tokenized with {docs.tokenizer_label}, "
                            f"but data.tokenizer is {tokenizer.label}; re-run `diffjax prepare`")
    else:
        docs = sources.load_corpus(data_cfg.path, data_cfg.source, text_field=data_cfg.text_field,
                                   text_split=data_cfg.text_split).documents
    if split is None:
        return docs
    return _Subset(docs, split_indices(len(docs), data_cfg.val_fraction, data_cfg.split_seed)[split])


def _unreadable_shard(source: prepare.ShardSource, error: Exception) -> DataError:
    """A shard read that failed after the shards were checked: removed (or made unreadable) during the run. Linux
    keeps a file its reader holds open readable, so this is a shard not read until then."""
    missing = [source.directory / s["file"] for s in source.metadata["shards"]
               if not (source.directory / s["file"]).is_file()]
    failed = next((m for m in missing if str(m) in str(error)), missing[0] if missing else None)  # the one read
    others = f" ({len(missing) - 1} more are gone too)" if len(missing) > 1 else ""
    what = (f"{failed}: removed while the run read the shards{others}" if missing else
            f"{source.directory}: a shard became unreadable while the run read it ({' '.join(str(error).split())})")
    return DataError(f"{what}: put them back, then rerun the same command (a training run resumes from its last "
                     f"checkpoint)")


def make_dataset(data_cfg, *, split: str = "train", tokenizer=None, process_index: int | None = None,
                 process_count: int | None = None, read_threads: int = 4) -> grain.IterDataset:
    """The Grain IterDataset of batches for this process (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    data_cfg.validate()
    tokenizer = tokenizer or get_tokenizer(data_cfg.tokenizer)
    if tokenizer.name != data_cfg.tokenizer:
        raise DataError(f"tokenizer {tokenizer.name!r} given, but data.tokenizer is {data_cfg.tokenizer!r}")
    index, count = _process_info(process_index, process_count)
    if data_cfg.batch_size % count:
        raise ValueError(f"data.batch_size {data_cfg.batch_size} is not divisible by {count} processes")
    local_batch = data_cfg.batch_size // count
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * local_batch)

    if data_cfg.source == "synthetic":
        ds = grain.MapDataset.source(synthetic.SyntheticSource(data_cfg, tokenizer, split))[index::count]
        ds = ds.to_iter_dataset(read)
    else:
        docs = documents(data_cfg, tokenizer, split)
        ids = np.arange(len(docs))[index::count]
        if len(ids) == 0:
            raise DataError(f"{data_cfg.path}: no {split} documents for process {index} of {count} "
                            f"({len(docs.source)} documents, val_fraction={data_cfg.val_fraction})")
        ds = grain.MapDataset.source(_Subset(docs, ids))
        if split == "train":
            ds = ds.shuffle(seed=data_cfg.seed)  # reseeded every epoch by repeat()
        ds = ds.repeat().map(functools.partial(_to_pair, tokenizer)).to_iter_dataset(read)
        seq = {"tokens": data_cfg.seq_len, "targets": data_cfg.seq_len}
        ds = ConcatThenSplitIterDataset(ds, length_struct=seq).map(_finalize)
    ds = ds.batch(local_batch, drop_remainder=True)
    if data_cfg.num_workers > 0:
        _absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.num_workers))
    return ds


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside an absl app they must be marked parsed first."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class DataIterator(grain.DatasetIterator):
    """A Grain iterator (so Orbax's `grain.checkpoint` works) whose `get_state()` is plain JSON, with `.next()`."""

    def __init__(self, inner: grain.DatasetIterator):
        super().__init__(inner)
        self._inner = inner

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._inner)

    next = __next__

    def get_state(self) -> dict:
        return _to_json(self._inner.get_state())

    def set_state(self, state: dict) -> None:
        self._inner.set_state(_from_json(state))

    def close(self) -> None:
        self._inner.close()


def make_iterator(data_cfg, *, split: str = "train", tokenizer=None, process_index: int | None = None,
                  process_count: int | None = None) -> DataIterator:
    """A fresh iterator over this process's batches; a fresh "val" iterator always yields the same batches."""
    return DataIterator(iter(make_dataset(data_cfg, split=split, tokenizer=tokenizer, process_index=process_index,
                                          process_count=process_count)))


def validation_iterator(data_cfg, **kw) -> DataIterator:
    """The whole validation split, as every process of a replicated evaluation reads it (whatever the count)."""
    return make_iterator(data_cfg, split="val", process_index=0, process_count=1, **kw)


def _to_json(x):
    """Grain states hold tuples that JSON would turn into lists (and the packer compares them to tuples)."""
    if isinstance(x, tuple):
        return {"__tuple__": [_to_json(v) for v in x]}
    if isinstance(x, dict):
        return {str(k): _to_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, bytes):
        return {"__bytes__": x.hex()}
    return x


def _from_json(x):
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_from_json(v) for v in x["__tuple__"])
        if set(x) == {"__bytes__"}:
            return bytes.fromhex(x["__bytes__"])
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x

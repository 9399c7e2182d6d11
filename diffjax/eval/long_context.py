"""Protocol "long_context": cumulative average NLL by position over whole unpacked documents (paper §3.3, Fig. 4;
Reid et al., 2024); the documents and lengths: docs/design.md §6, "Protocol details"."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import flax.linen as nn
import numpy as np

from diffjax import sharding
from diffjax.config import Config, ConfigError
from diffjax.data import pipeline, prepare, sources
from diffjax.data.sources import DataError
from diffjax.data.synthetic import SyntheticSource
from diffjax.data.tokenizer import get_tokenizer
from diffjax.eval import Protocol, progress, register, table
from diffjax.train.loss import training_token_losses

SPLITS = ("val", "train", "all")


def _source_of(path: str) -> str:
    p = Path(path)
    return "shards" if (p / prepare.METADATA).is_file() else "jsonl" if p.suffix in sources.JSONL_SUFFIXES else "text"


def _candidates(cfg: Config, tokenizer, split: str, path: str | None, source: str | None):
    """(description, random-access documents: strings or token-id arrays)."""
    if split not in SPLITS:
        raise ConfigError(f"eval.split: choose one of {SPLITS}, got {split!r}")
    if path is not None:
        data_cfg = dataclasses.replace(cfg.data, path=path, source=source or _source_of(path))
        return f"{path} ({data_cfg.source})", pipeline.documents(data_cfg, tokenizer)
    if source is not None:
        raise ConfigError("eval.source needs eval.path")
    where = f"{cfg.data.path} ({cfg.data.source}, {split} documents)"
    return where, pipeline.documents(cfg.data, tokenizer, None if split == "all" else split)


def _synthetic_documents(cfg: Config, tokenizer, length: int, n_docs: int) -> np.ndarray:
    source = SyntheticSource(cfg.data, tokenizer, "val")
    per_doc = math.ceil((length + 1) / (cfg.data.seq_len + 2))  # each example is seq_len + 1 tokens, + EOS
    docs = []
    for j in range(n_docs):
        rows = [source[j * per_doc + i] for i in range(per_doc)]
        ids = np.concatenate([np.append(r["tokens"], [r["targets"][-1], tokenizer.eos_id]) for r in rows])
        docs.append(ids[: length + 1])
    return np.stack(docs).astype(np.int32)


def long_documents(cfg: Config, length: int, *, n_docs: int = 8, split: str = "val", path: str | None = None,
                   source: str | None = None) -> tuple[np.ndarray, str]:
    """([n, length + 1] int32 ids of up to `n_docs` documents of >= `length` tokens then EOS, where they came from)."""
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    if path is None and source is None and cfg.data.source == "synthetic":
        return _synthetic_documents(cfg, tokenizer, length, n_docs), "synthetic validation examples joined by EOS"
    where, docs = _candidates(cfg, tokenizer, split, path, source)
    found, longest, short_bytes = [], 0, []
    for i in range(len(docs)):
        doc = docs[i]
        if isinstance(doc, str):
            n_bytes = len(doc.encode("utf-8"))
            if n_bytes < length:  # both tokenizers give at most one token per byte: too short, skip encoding
                short_bytes.append((n_bytes, i))
                continue
            ids = np.asarray(tokenizer.encode(doc), np.int32)
        else:
            ids = np.asarray(doc, np.int32)
        longest = max(longest, len(ids))
        if len(ids) >= length:
            found.append(np.append(ids[: length + 1], np.int32(tokenizer.eos_id))[: length + 1])
            if len(found) == n_docs:
                break
    if not found:
        for n_bytes, i in sorted(short_bytes, reverse=True):  # the exact longest, for the message
            if n_bytes <= longest:
                break
            longest = max(longest, len(tokenizer.encode(docs[i])))
        raise DataError(f"{where}: no document of at least {length} tokens ({len(docs)} documents, the longest "
                        f"has {longest} {tokenizer.name} tokens); lower eval.length or use longer documents")
    return np.stack(found).astype(np.int32), where


def token_nll(cfg: Config, params, docs: np.ndarray, *, rope_theta: float | None = None,
              batch_size: int = 1) -> np.ndarray:
    """Per-token NLL [n, length] of documents [n, length + 1], one document per row (no packing)."""
    if rope_theta is not None:
        if rope_theta <= 0:
            raise ConfigError(f"eval.rope_theta must be positive, got {rope_theta}")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_theta=float(rope_theta)))
    # under the params' mesh, as training runs (context-parallel where it divides), giving back no logits
    step = sharding.MeshJit(lambda p, batch: training_token_losses(p, batch, cfg), sharding.mesh_of(params))
    params = nn.meta.unbox(params)
    out = []
    for start in progress(range(0, len(docs), batch_size), "long-context NLL"):
        rows = docs[start:start + batch_size]
        b, t = rows.shape[0], rows.shape[1] - 1
        batch = {"tokens": rows[:, :-1], "targets": rows[:, 1:],
                 "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
                 "segment_ids": np.ones((b, t), np.int32)}
        out.append(np.asarray(step(params, batch), np.float64))
    return np.concatenate(out)


def grid(length: int, points: int) -> list[int]:
    """1-based positions: ~`points` log-spaced ones, every power of two, and `length`."""
    logs = np.unique(np.round(np.geomspace(1, length, max(points, 2))).astype(int))
    pow2 = 2 ** np.arange(int(math.log2(length)) + 1)
    return sorted({int(x) for x in logs} | {int(x) for x in pow2} | {length})


def run(cfg: Config, params, *, length: int | None = None, n_docs: int = 8, rope_theta: float | None = None,
        split: str = "val", path: str | None = None, source: str | None = None, batch_size: int = 1,
        points: int = 256) -> dict:
    """{"positions": 1-based positions, "cumulative_nll": the averaged cumulative NLL at them, "final_nll", …}."""
    length = cfg.data.seq_len if length is None else length
    if length < 1 or n_docs < 1 or batch_size < 1:
        raise ConfigError(f"eval.length, eval.n_docs and eval.batch_size must be positive, got {length}, "
                          f"{n_docs}, {batch_size}")
    docs, where = long_documents(cfg, length, n_docs=n_docs, split=split, path=path, source=source)
    nll = token_nll(cfg, params, docs, rope_theta=rope_theta, batch_size=batch_size)
    curve = (np.cumsum(nll, axis=1) / np.arange(1, length + 1)).mean(axis=0)
    positions = grid(length, points)
    return {"length": length, "documents": len(docs), "source": where, "train_seq_len": cfg.data.seq_len,
            "rope_theta": float(cfg.model.rope_theta if rope_theta is None else rope_theta),
            "positions": positions, "cumulative_nll": [float(curve[p - 1]) for p in positions],
            "final_nll": float(curve[-1])}


def applies(cfg: Config) -> bool:
    return cfg.data.source != "synthetic"  # synthetic sequences have no long documents to speak of


def markdown(results: dict[str, dict]) -> str:
    longest = max(r["length"] for r in results.values())
    cols = sorted({2**k for k in range(int(math.log2(longest)) + 1)} | {r["length"] for r in results.values()})
    rows = []
    for label, r in results.items():
        at = dict(zip(r["positions"], r["cumulative_nll"], strict=True))
        cells = [f"{at[p]:.3f}" if p in at else "–" for p in cols]
        rows.append([label, f"{r['rope_theta']:g}", str(r["documents"]), *cells])
    return ("Cumulative average NLL by position (paper §3.3, Fig. 4; lower is better)\n\n"
            + table(["run", "θ", "docs", *(f"{p:,}" for p in cols)], rows) + "\n")


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    fig, ax = subplots(figsize=(5.5, 3.5))
    for label, r in results.items():
        ax.plot(r["positions"], r["cumulative_nll"], label=f"{label} (θ={r['rope_theta']:g})")
    for seq_len in sorted({r["train_seq_len"] for r in results.values()}):
        if seq_len < max(r["length"] for r in results.values()):
            ax.axvline(seq_len, color="grey", ls=":", lw=1)  # beyond it: length extrapolation
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequence position", ylabel="cumulative average NLL", title="Long-context NLL")
    ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("long_context", run, applies, markdown=markdown, plot=plot))

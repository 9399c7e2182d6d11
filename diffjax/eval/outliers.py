"""Protocol "outliers": the largest |attention logits| and |hidden states| over a validation-token budget, and their
exact median by a two-pass radix select (paper §3.7, Table 5; docs/design.md §6, "Protocol details")."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import Config, ConfigError, ModelConfig
from diffjax.data.pipeline import validation_iterator
from diffjax.data.sources import DataError
from diffjax.eval import Protocol, progress, register, table
from diffjax.kernels import reference
from diffjax.model import archs, sown_per_layer

TOPS = (1, 2, 3, 10, 100)
KINDS = ("attention_logits", "hidden_states")
NBINS = 1 << 16  # 16 of the 32 bits of a float32 per pass


def _values(cfg: ModelConfig, kind: str, sown, segment_ids, take):
    """(|values|, the mask of the entries that count, broadcast to their shape) of one layer: its output
    (`sown` the hidden state) or every softmax map's logits side by side on the head axis (`sown` the attention's)."""
    if kind == "hidden_states":
        values, mask = jnp.abs(sown.astype(jnp.float32)), take[:, :, None]
    else:
        b, t = take.shape
        mask = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids)
        values = jnp.abs(jnp.concatenate(list(archs.get(cfg.arch).attention_logits(cfg, sown, mask).values()), 1))
        mask = mask & take[:, None, :, None]
    return values, jnp.broadcast_to(mask, values.shape)


def _histogram(bins, weights):
    """Per-row counts [B, NBINS] of `bins` [B, N], summed over rows when the total cannot overflow int32."""
    b = bins.shape[0]
    counts = jnp.zeros((b, NBINS), jnp.int32).at[jnp.arange(b)[:, None], bins].add(weights.astype(jnp.int32))
    return counts.sum(0, keepdims=True) if bins.size < 2**31 else counts  # host sums in int64


def _split_bits(values):
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    return (bits >> 16).astype(jnp.int32), (bits & 0xFFFF).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "kind"))
def _pass1(cfg, kind, sown, segment_ids, take):
    """(the top min(100, n) counted values, descending, −1 where fewer count; counts by high 16 bits)."""
    values, mask = _values(cfg, kind, sown, segment_ids, take)
    b = values.shape[0]
    flat = jnp.where(mask, values, -1.0).reshape(-1)
    top, _ = jax.lax.top_k(flat, min(TOPS[-1], flat.size))
    high, _ = _split_bits(values)
    return top, _histogram(high.reshape(b, -1), mask.reshape(b, -1))


@functools.partial(jax.jit, static_argnames=("cfg", "kind"))
def _pass2(cfg, kind, sown, segment_ids, take, targets):
    """Counts by low 16 bits of the counted values whose high 16 bits equal each of `targets`: [len, ..., NBINS]."""
    values, mask = _values(cfg, kind, sown, segment_ids, take)
    high, low = _split_bits(values)
    b = values.shape[0]
    return jnp.stack([_histogram(low.reshape(b, -1), (mask & (high == target)).reshape(b, -1))
                      for target in targets])


@functools.lru_cache(maxsize=8)
def _forward(cfg: ModelConfig):
    return jax.jit(functools.partial(sown_per_layer, cfg))


def _calls(cfg: ModelConfig, params, batches):
    """Per layer of every batch: [(kind, layer, sown, segment_ids, take)] of its attention and of its output."""
    forward = _forward(cfg)
    for batch in batches:
        seg, take = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["take"])
        layers = forward(params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), seg)
        for i, layer in enumerate(layers):
            yield [("attention_logits", i, layer["attn"], seg, take), ("hidden_states", i, layer["hidden"], seg, take)]


def _budget_batches(cfg: Config, tokens: int, batch_size: int) -> list[dict]:
    """The validation batches holding the first `tokens` real tokens, each with its "take" mask [B, T]."""
    data_cfg = dataclasses.replace(cfg.data, batch_size=batch_size) if batch_size else cfg.data
    data, out, seen = validation_iterator(data_cfg), [], 0
    try:
        while seen < tokens:
            batch = data.next()
            real = np.asarray(batch["segment_ids"]) > 0
            if not real.any():
                raise DataError("a validation batch holds no real tokens (segment_ids > 0); cannot fill the budget")
            take = real & (seen + np.cumsum(real.reshape(-1)).reshape(real.shape) <= tokens)
            seen += int(take.sum())
            out.append({**{k: batch[k] for k in ("tokens", "positions", "segment_ids")}, "take": take})
    finally:
        data.close()
    return out


def merge_top(running: np.ndarray, new: np.ndarray, k: int = TOPS[-1]) -> np.ndarray:
    """The k largest of `running` ∪ `new`, descending (exact: a value of the overall top k is in its call's)."""
    return np.sort(np.concatenate([running, new]))[::-1][:k]


def _order_statistic(high_counts: np.ndarray, rank: int) -> tuple[int, int]:
    """(high bin, rank inside it) of the `rank`-th smallest value (0-based)."""
    cum = np.cumsum(high_counts)
    bin_ = int(np.searchsorted(cum, rank, side="right"))
    return bin_, rank - int(cum[bin_ - 1] if bin_ else 0)


def _bits_to_float(high: int, low: int) -> float:
    return float(np.array([(high << 16) | low], np.uint32).view(np.float32)[0])


def outliers(cfg: Config, params, *, tokens: int = 16384, batch_size: int = 0) -> dict:
    """Table 5 statistics over the first `tokens` real validation tokens: {kind: {"top": {"1": .., "100": ..}, "median",
    "count", "per_layer_max"}, "tokens", "batches", "median_exact"}; `batch_size` (0: `data.batch_size`) rows a pass."""
    if tokens <= 0 or batch_size < 0:
        raise ConfigError(f"eval.tokens must be positive and eval.batch_size >= 0, got {tokens} and {batch_size}")
    params, model_cfg = nn.meta.unbox(params), cfg.model
    batches = _budget_batches(cfg, tokens, batch_size)

    def calls(description: str):
        return (call for layer in progress(_calls(model_cfg, params, batches), description,
                                           total=len(batches) * model_cfg.n_layers) for call in layer)

    top = {k: np.empty(0, np.float32) for k in KINDS}
    high = {k: np.zeros(NBINS, np.int64) for k in KINDS}
    layer_max = {k: np.full(model_cfg.n_layers, -np.inf) for k in KINDS}
    for kind, i, sown, seg, take in calls("outliers pass 1"):
        best, counts = jax.device_get(_pass1(model_cfg, kind, sown, seg, take))
        best = best[best >= 0]
        top[kind] = merge_top(top[kind], best)
        high[kind] += counts.astype(np.int64).sum(0)
        if best.size:
            layer_max[kind][i] = max(layer_max[kind][i], float(best[0]))

    # The middle rank(s) of each pool: (N − 1) // 2 and N // 2, located in their high bins.
    wanted = {}
    for kind in KINDS:
        n = int(high[kind].sum())
        wanted[kind] = [_order_statistic(high[kind], r) for r in sorted({(n - 1) // 2, n // 2})]
    targets = {k: jnp.asarray([b for b, _ in wanted[k]], jnp.int32) for k in KINDS}
    low = {k: np.zeros((len(wanted[k]), NBINS), np.int64) for k in KINDS}
    for kind, _, sown, seg, take in calls("outliers pass 2"):
        counts = jax.device_get(_pass2(model_cfg, kind, sown, seg, take, targets[kind]))
        low[kind] += counts.astype(np.int64).reshape(len(wanted[kind]), -1, NBINS).sum(1)

    result: dict = {"tokens": int(sum(b["take"].sum() for b in batches)), "batches": len(batches),
                    "median_exact": True}
    for kind in KINDS:
        middle = []
        for j, (bin_, offset) in enumerate(wanted[kind]):
            result["median_exact"] &= int(low[kind][j].sum()) == int(high[kind][bin_])
            middle.append(_bits_to_float(bin_, int(np.searchsorted(np.cumsum(low[kind][j]), offset, side="right"))))
        values = top[kind]
        result[kind] = {"top": {str(k): float(values[k - 1]) if values.size >= k else None for k in TOPS},
                        "median": float(np.mean(np.asarray(middle, np.float64))), "count": int(high[kind].sum()),
                        "per_layer_max": [float(x) for x in layer_max[kind]]}
    return result


LABELS = {"attention_logits": "Attention Logits", "hidden_states": "Hidden States"}


def _cell(x) -> str:
    return "–" if x is None else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def markdown(results: dict[str, dict]) -> str:
    rows = [[label, LABELS[kind], *(_cell(r[kind]["top"][str(k)]) for k in TOPS), _cell(r[kind]["median"])]
            for kind in KINDS for label, r in results.items()]
    tokens = ", ".join(f"{label}: {r['tokens']}" for label, r in results.items())
    return (f"Largest activation values (paper §3.7, Table 5) over validation tokens ({tokens})\n\n"
            + table(["Model", "Activation Type", *(f"Top-{k}" for k in TOPS), "Median"], rows) + "\n")


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    columns = [f"Top-{k}" for k in TOPS] + ["Median"]
    fig, axes = subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(results)
    for ax, kind in zip(axes, KINDS, strict=True):
        for j, (label, r) in enumerate(results.items()):
            values = [r[kind]["top"][str(k)] for k in TOPS] + [r[kind]["median"]]
            values = [np.nan if v is None or v <= 0 else v for v in values]  # log axis
            ax.bar(np.arange(len(columns)) + (j - (len(results) - 1) / 2) * width, values, width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(columns)), columns, fontsize=8)
        ax.set(title=LABELS[kind], ylabel="|activation|")
        ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("outliers", outliers, markdown=markdown, plot=plot))

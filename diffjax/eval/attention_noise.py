"""Protocol "attention_noise": the shares of the answer-predicting queries' normalised attention (a / Σ|a|) on the
answer needle, the rest of the context and the question (paper §3.4, Table 3; docs/design.md §6, "Protocol details")."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import Config, ConfigError, ModelConfig
from diffjax.data.synthetic import DEPTHS, retrieval_examples
from diffjax.data.tokenizer import TOKENIZERS, get_tokenizer
from diffjax.eval import Protocol, progress, register, table
from diffjax.kernels import reference
from diffjax.model import archs, sown_per_layer

SHARES = ("answer", "noise", "question", "negative", "row_sum")


def row_shares(maps, query, answer, context) -> dict:
    """{share: [B, H]} of one layer's map rows [B, H, R, S], averaged over the rows `query` [B, R] marks; `answer` /
    `context` [B, S] mark the answer span and the context (the keys before the first question)."""
    maps = jnp.asarray(maps, jnp.float32)
    answer, context = jnp.asarray(answer, bool), jnp.asarray(context, bool)
    row_sum = maps.sum(-1)
    p = maps / jnp.abs(maps).sum(-1, keepdims=True)

    def over(keys):  # [B, S] -> [B, H, T]
        return jnp.einsum("bhts,bs->bht", p, keys.astype(jnp.float32))

    per_row = {"answer": over(answer), "noise": over(context & ~answer), "question": over(~context),
               "negative": jnp.minimum(p, 0.0).sum(-1), "row_sum": row_sum}
    weights = jnp.asarray(query, jnp.float32)
    weights = weights / weights.sum(-1, keepdims=True)
    return {k: jnp.einsum("bht,bt->bh", v, weights) for k, v in per_row.items()}


def span_masks(batch: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(query rows [B, R], which of them to average, answer-needle keys [B, T], context keys [B, T]) of a
    `retrieval_examples` batch: R covers the widest answer span, rounded up to a power of two (one compile)."""
    pos = np.arange(np.asarray(batch["tokens"]).shape[1])
    start, end = np.asarray(batch["answer_start"])[:, :1], np.asarray(batch["answer_end"])[:, :1]
    width = 1 << int(np.max(end - start) - 1).bit_length()
    rows = start + np.arange(width)
    query = rows < end
    answer = (pos >= np.asarray(batch["needle_start"])[:, None]) & (pos < np.asarray(batch["needle_end"])[:, None])
    context = pos < np.asarray(batch["context_len"])[:, None]
    return np.minimum(rows, end - 1), query, answer, context


@functools.lru_cache(maxsize=8)
def _compiled(cfg: ModelConfig):
    """(forward -> intermediates, one layer's sown values -> shares), jitted once per config (and shape)."""
    forward, attention_map = jax.jit(functools.partial(sown_per_layer, cfg)), archs.get(cfg.arch).attention_map

    @jax.jit
    def layer(sown, segment_ids, rows, query, answer, context):
        b, t = segment_ids.shape
        mask = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids)
        return row_shares(attention_map(cfg, sown, mask, rows), query, answer, context)

    return forward, layer


def noise_shares(cfg: Config | ModelConfig, params, batch: dict, *, per_head: bool = False) -> dict[str, np.ndarray]:
    """{share: [B, L]} (averaged over heads; [B, L, H] with `per_head`) of a `retrieval_examples` batch, from one
    layer's answer-span rows [B, H, R, T] at a time: O(T) memory, not O(T²) (but DINT's integral needs every row)."""
    model_cfg = cfg.model if isinstance(cfg, Config) else cfg
    forward, layer = _compiled(model_cfg)
    seg = jnp.asarray(batch["segment_ids"])
    layers = forward(nn.meta.unbox(params), jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), seg)
    masks = [jnp.asarray(m) for m in span_masks(batch)]
    shares = [layer(sown["attn"], seg, *masks) for sown in layers]
    stacked = {k: np.stack([np.asarray(s[k]) for s in shares], axis=1) for k in SHARES}  # [B, L, H]
    return stacked if per_head else {k: v.mean(-1) for k, v in stacked.items()}


def attention_noise(cfg: Config, params, *, n: int = 32, batch_size: int | None = None,
                    depths: tuple[float, ...] = DEPTHS, n_needles: int | None = None,
                    n_query_cities: int | None = None, seed: int | None = None) -> dict:
    """{share: [per depth]} averaged over examples, heads and layers, and "per_layer": {share: [depth][layer]}."""
    batch_size = min(8, cfg.data.batch_size) if batch_size is None else batch_size
    if n <= 0 or batch_size <= 0:
        raise ConfigError(f"eval.n and eval.batch_size must be positive, got {n} and {batch_size}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"eval.depths: need depths in [0, 1], got {depths}")
    n_needles = cfg.data.n_needles if n_needles is None else n_needles
    n_query_cities = cfg.data.n_query_cities if n_query_cities is None else n_query_cities
    tokenizer, size = get_tokenizer(cfg.data.tokenizer), min(batch_size, n)
    result: dict = {"n": n, "seq_len": cfg.data.seq_len, "n_needles": n_needles, "n_query_cities": n_query_cities,
                    "n_layers": cfg.model.n_layers, "depths": [float(d) for d in depths],
                    **{k: [] for k in SHARES}, "per_layer": {k: [] for k in SHARES}}
    for depth in progress(depths, "attention_noise"):
        # DataError (the needles do not fit in seq_len) propagates: the request itself is impossible.
        batch = retrieval_examples(cfg.data, n, depth=depth, tokenizer=tokenizer, seed=seed, n_needles=n_needles,
                                   n_query_cities=n_query_cities)
        chunks = []
        for start in range(0, n, size):
            # pad the last chunk with copies of its last row so every call has one shape (one compile)
            rows = {k: v[start:start + size] for k, v in batch.items()}
            m = len(rows["tokens"])
            rows = {k: np.concatenate([v, np.repeat(v[-1:], size - m, axis=0)]) for k, v in rows.items()}
            chunks.append({k: v[:m] for k, v in noise_shares(cfg, params, rows).items()})
        for k in SHARES:
            by_layer = np.concatenate([c[k] for c in chunks]).mean(0)  # [L]
            result["per_layer"][k].append([float(x) for x in by_layer])
            result[k].append(float(by_layer.mean()))
    return result


def applies(cfg: Config) -> bool:
    return cfg.data.source == "synthetic" and "retrieval" in cfg.data.tasks and cfg.data.tokenizer in TOKENIZERS


def markdown(results: dict[str, dict]) -> str:
    first = next(iter(results.values()))
    by_depth = [[label, f"{share} {arrow}", *(f"{v:.3f}" for v in r[share])] for label, r in results.items()
                for share, arrow in (("answer", "↑"), ("noise", "↓"))]
    by_layer = []
    for label, r in results.items():
        mean = {k: np.mean(np.asarray(r["per_layer"][k], float), axis=0) for k in SHARES}
        by_layer += [[label, str(i + 1), *(f"{mean[k][i]:.3f}" for k in SHARES)] for i in range(len(mean["answer"]))]
    return "\n".join([
        f"Attention to the answer span and attention noise in retrieval (paper §3.4, Table 3): normalised "
        f"attention of the answer-predicting queries, averaged over heads and layers; N={first['n_needles']} "
        f"needles, R={first['n_query_cities']}, {first['seq_len']} tokens, {first['n']} examples per depth.", "",
        table(["run", "share", *(f"{d:.0%}" for d in first["depths"])], by_depth), "",
        "Per layer (mean over depths and heads); question = the question and given answer tokens, "
        "negative = summed negative entries of the normalised rows, row sum = before normalising.", "",
        table(["run", "layer", "answer", "noise", "question", "negative", "row sum"], by_layer)]) + "\n"


def plot(results: dict[str, dict], path) -> None:
    from matplotlib.ticker import MaxNLocator

    from diffjax.plotting import save, subplots

    fig, axes = subplots(1, 3, figsize=(13, 3.6))
    for i, (label, r) in enumerate(results.items()):
        color = f"C{i}"
        axes[0].plot(r["depths"], r["answer"], "o-", color=color, label=label)
        axes[1].plot(r["depths"], r["noise"], "o-", color=color, label=label)
        layers = np.arange(1, len(r["per_layer"]["answer"][0]) + 1)  # numbered from 1, as report.png does
        axes[2].plot(layers, np.mean(r["per_layer"]["answer"], axis=0), "o-", color=color, label=f"{label} answer")
        axes[2].plot(layers, np.mean(r["per_layer"]["noise"], axis=0), "s--", color=color, label=f"{label} noise")
    axes[0].set(xlabel="answer depth", ylabel="attention to answer ↑", title="answer span")
    axes[1].set(xlabel="answer depth", ylabel="attention noise ↓", title="rest of the context")
    axes[2].set(xlabel="layer", ylabel="share (mean over depths)", title="per layer")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        low, high = ax.get_ylim()  # from 0 (and at least to 0.5): a 0.14–0.15 sliver would look like a cliff
        ax.set_ylim(min(low, 0.0) - 0.02, max(high, 0.5) + 0.02)
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=7)
    fig.suptitle("normalised attention of the answer-predicting queries (a / Σ|a|, mean over heads)")
    save(fig, path)


register(Protocol("attention_noise", attention_noise, applies, markdown=markdown, plot=plot))

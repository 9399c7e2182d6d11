"""Protocol "icl": many-shot in-context classification by constrained decoding on the KV cache (paper §3.5, Figs. 6
and 7); the prompt, scoring, data and arrangements: docs/design.md §6, "Protocol details"."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import Config, ConfigError, ModelConfig
from diffjax.data import classification
from diffjax.data.sources import DataError
from diffjax.data.tokenizer import get_tokenizer
from diffjax.eval import Protocol, progress, register, table
from diffjax.model import decode_step, init_cache

PROMPT = "Input: {text}\nLabel:"
ANSWER = " {label}\n"
PROMPT_FORMAT = "Input: <text>\\nLabel: <label>\\n"
ARRANGEMENTS = ("random", "alternating")
PIECES = (1024, 64)  # prompts are appended to the cache in pieces of these sizes, the last one padded


@functools.cache
def _batch_axes(cfg: ModelConfig):
    """The batch axis of every KV-cache leaf (-1 for none: the write index), from caches of batch 1 and 2."""
    one, two = (jax.eval_shape(functools.partial(init_cache, cfg, b, 8)) for b in (1, 2))
    return jax.tree.map(lambda a, b: next((i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True))
                                           if x != y), -1), one, two)


@functools.partial(jax.jit, static_argnames="cfg")
def _append(cfg: ModelConfig, params, cache, tokens, n_real):
    """(cache, log-probabilities of the next token) after tokens [1, S] whose first `n_real` are real: the write
    index moves back over the padding, whose entries no later query sees and later writes replace."""
    logits, cache = decode_step(cfg, params, cache, tokens)
    drop = tokens.shape[1] - n_real
    cache = jax.tree.map(lambda x, ax: x - drop if ax < 0 else x, cache, _batch_axes(cfg))
    return cache, jax.nn.log_softmax(logits[0, n_real - 1])


@functools.partial(jax.jit, static_argnames="cfg")
def _continuations(cfg: ModelConfig, params, cache, inputs, targets, weights):
    """Summed log p(targets | cache, inputs) per row [K] of inputs [K, W]; the cache (batch 1) is tiled to K."""
    k = inputs.shape[0]
    tiled = jax.tree.map(lambda x, ax: x if ax < 0 else jnp.repeat(x, k, axis=ax), cache, _batch_axes(cfg))
    logits, _ = decode_step(cfg, params, tiled, inputs)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    return jnp.sum(logp * weights, axis=-1)


class CachedScorer:
    """Label log-likelihoods after a prompt, on a KV cache of `max_len` tokens."""

    def __init__(self, cfg: Config, params, max_len: int, label_batch: int = 16):
        self.model_cfg, self.max_len, self.label_batch = cfg.model, max_len, label_batch
        self.params = nn.meta.unbox(params)

    def empty(self):
        # room for the padding of a last piece past max_len (a write past the end would be shifted back)
        return init_cache(self.model_cfg, 1, self.max_len + PIECES[-1])

    def extend(self, cache, ids):
        """(the cache with `ids` appended, log-probabilities [V] of the token after the last one)."""
        if not ids:
            raise ValueError("extend needs at least one token")
        pos = 0
        while pos < len(ids):
            size = next((p for p in PIECES if len(ids) - pos >= p), PIECES[-1])
            n = min(size, len(ids) - pos)
            piece = np.pad(np.asarray(ids[pos:pos + n], np.int32), (0, size - n))[None]
            cache, next_logprobs = _append(self.model_cfg, self.params, cache, piece, np.int32(n))
            pos += n
        return cache, np.asarray(next_logprobs, np.float64)

    def label_logprobs(self, cache, next_logprobs, candidates: list[list[int]]) -> np.ndarray:
        """[K] summed log-likelihood of each candidate's tokens after the prompt in `cache` (next: `next_logprobs`)."""
        scores = np.array([next_logprobs[c[0]] for c in candidates], np.float64)
        width = max(len(c) for c in candidates) - 1
        if width == 0:
            return scores
        inputs = np.zeros((len(candidates), width), np.int32)
        targets, weights = np.zeros_like(inputs), np.zeros(inputs.shape, np.float32)
        for i, c in enumerate(candidates):  # candidate i: feed c[:-1] (after c[0]), score c[1:]
            inputs[i, : len(c) - 1], targets[i, : len(c) - 1], weights[i, : len(c) - 1] = c[:-1], c[1:], 1.0
        kb = min(self.label_batch, len(candidates))
        pad = -len(candidates) % kb  # a full last batch keeps one compiled shape; padded rows are dropped
        inputs, targets, weights = (np.concatenate([x, np.repeat(x[-1:], pad, 0)]) for x in (inputs, targets, weights))
        sums = [np.asarray(_continuations(self.model_cfg, self.params, cache, inputs[i:i + kb], targets[i:i + kb],
                                          weights[i:i + kb])) for i in range(0, len(inputs), kb)]
        return scores + np.concatenate(sums)[: len(candidates)]


def arrange(demo_labels, arrangement: str, seed) -> list[int]:
    """A seeded order (a permutation of indices) of demonstrations with classes `demo_labels`."""
    rng = np.random.default_rng(seed)
    if arrangement == "random":
        return [int(i) for i in rng.permutation(len(demo_labels))]
    if arrangement != "alternating":
        raise ConfigError(f"unknown arrangement {arrangement!r}; choose one of {ARRANGEMENTS}")
    classes = sorted(set(demo_labels))
    groups = {c: [i for i, y in enumerate(demo_labels) if y == c] for c in classes}
    groups = {c: [g[j] for j in rng.permutation(len(g))] for c, g in groups.items()}  # in class order: same draws
    order, cycle = [], [classes[j] for j in rng.permutation(len(classes))]
    while len(order) < len(demo_labels):
        order.extend(groups[c].pop(0) for c in cycle if groups[c])
    return order


def split(records: list[dict], n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(test examples, demonstration pool): the first `n_test` of a seeded shuffle, and the rest."""
    if not 1 <= n_test < len(records):
        raise ConfigError(f"eval.n_test: need 1 <= n_test < {len(records)} records (some are left for "
                          f"demonstrations), got {n_test}")
    perm = np.random.default_rng([seed, 0x1C1]).permutation(len(records))
    shuffled = [records[i] for i in perm]
    return shuffled[:n_test], shuffled[n_test:]


SHOTS = tuple(2**k for k in range(13))  # 1 … 4096, each clamped to what fits


def run(cfg: Config, params, *, path: str | None = None, shots: tuple[int, ...] = SHOTS,
        n_test: int = 64, seed: int = 0, permutations: int = 5, robust_shots: int | None = None,
        max_len: int | None = None, label_batch: int = 16, n_synthetic: int = 512, n_classes: int = 4) -> dict:
    """{"by_shots": {n: accuracy}, "cap": the most demonstrations that fit, "robustness": {arrangement:
    {accuracy: [per seed], best, worst, margin}}, …}."""
    max_len = cfg.data.seq_len if max_len is None else max_len
    if not shots or min(shots) < 1 or max_len < 2 or label_batch < 1 or permutations < 0:
        raise ConfigError(f"eval.shots must be positive and non-empty, eval.max_len >= 2, eval.label_batch >= 1 "
                          f"and eval.permutations >= 0; got {shots}, {max_len}, {label_batch}, {permutations}")
    if path is None:
        records = classification.synthetic_examples(n_synthetic, seed, n_classes=n_classes)
        dataset = f"synthetic keyword task ({n_classes} classes, {n_synthetic} records, seed {seed})"
    else:
        records, dataset = classification.load(path), str(path)
    labels = sorted({r["label"] for r in records})
    if len(labels) < 2:
        raise DataError(f"{dataset}: a classification dataset needs at least 2 labels, found {labels}")
    test, pool = split(records, n_test, seed)

    tok = get_tokenizer(cfg.data.tokenizer)
    query = [tok.encode(PROMPT.format(text=r["text"])) for r in (*test, *pool)]
    candidates = [tok.encode(ANSWER.format(label=y)) for y in labels]
    demos = [q + candidates[labels.index(r["label"])] for q, r in zip(query[len(test):], pool, strict=True)]
    query, gold = query[: len(test)], [labels.index(r["label"]) for r in test]
    room = max_len - max(map(len, query)) - max(map(len, candidates))
    cap = int(np.searchsorted(np.cumsum([len(d) for d in demos]), room, side="right"))
    if cap < 1:
        raise ConfigError(f"eval.max_len={max_len} leaves no room for one demonstration ({dataset}: longest "
                          f"query {max(map(len, query))} + label {max(map(len, candidates))} tokens, first "
                          f"demonstration {len(demos[0])})")

    scorer = CachedScorer(cfg, params, max_len, label_batch)

    def accuracy(order: list[int]) -> float:
        cache, _ = scorer.extend(scorer.empty(), [t for i in order for t in demos[i]])
        hits = sum(int(np.argmax(scorer.label_logprobs(*scorer.extend(cache, q), candidates)) == y)
                   for q, y in zip(query, gold, strict=True))
        return hits / len(query)

    evaluated = sorted({min(s, cap) for s in shots})
    by_shots = {str(n): accuracy(list(range(n))) for n in progress(evaluated, "ICL accuracy by #demos")}
    result = {"dataset": dataset, "labels": len(labels), "n_test": len(test), "pool": len(pool),
              "max_len": max_len, "cap": cap, "prompt_format": PROMPT_FORMAT, "requested_shots": list(shots),
              "by_shots": by_shots, "mean_accuracy": float(np.mean(list(by_shots.values())))}
    if permutations:
        k = cap if robust_shots is None else min(robust_shots, cap)
        if k < 1:
            raise ConfigError(f"eval.robust_shots must be positive, got {robust_shots}")
        demo_labels = [r["label"] for r in pool[:k]]
        robustness = {"shots": k, "seeds": permutations}
        for arrangement in ARRANGEMENTS:
            accs = [accuracy(arrange(demo_labels, arrangement, [seed, s]))
                    for s in progress(range(permutations), f"ICL robustness ({arrangement})")]
            robustness[arrangement] = {"accuracy": accs, "mean": float(np.mean(accs)), "best": max(accs),
                                       "worst": min(accs), "margin": max(accs) - min(accs)}
        result["robustness"] = robustness
    return result


def applies(cfg: Config) -> bool:
    return cfg.data.source != "synthetic"  # models of the synthetic retrieval / MQAR tasks cannot read prompts


def markdown(results: dict[str, dict]) -> str:
    first = next(iter(results.values()))
    shots = sorted({int(n) for r in results.values() for n in r["by_shots"]})
    rows = [[label, *(f"{r['by_shots'][str(n)]:.3f}" if str(n) in r["by_shots"] else "–" for n in shots),
             f"{r['mean_accuracy']:.3f}", str(r["cap"])] for label, r in results.items()]
    text = (f"Many-shot in-context classification accuracy (paper §3.5, Fig. 6) on {first['dataset']}, "
            f"{first['n_test']} test examples, prompt \"{first['prompt_format']}\"\n\n"
            + table(["run", *(f"{n}-shot" for n in shots), "mean", "cap"], rows) + "\n")
    robust = {label: r["robustness"] for label, r in results.items() if "robustness" in r}
    if robust:
        stats = ("mean", "best", "worst", "margin")
        rows = [[label, a, str(rb["shots"]), str(rb["seeds"]), *(f"{rb[a][k]:.3f}" for k in stats)]
                for label, rb in robust.items() for a in ARRANGEMENTS]
        text += ("\nRobustness to demonstration order (paper Fig. 7; margin = best − worst)\n\n"
                 + table(["run", "arrangement", "#demos", "seeds", *stats], rows) + "\n")
    return text


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    robust = any("robustness" in r for r in results.values())
    fig, axes = subplots(1, 3 if robust else 1, figsize=(13 if robust else 5, 3.5), squeeze=False)
    ax = axes[0, 0]
    for label, r in results.items():
        n = sorted(int(k) for k in r["by_shots"])
        line, = ax.plot(n, [r["by_shots"][str(k)] for k in n], "o-", label=label)
        ax.axhline(r["mean_accuracy"], color=line.get_color(), ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="# demonstration examples", ylabel="accuracy", ylim=(-0.02, 1.02), title="Many-shot ICL")
    ax.legend(fontsize=8)
    for ax, arrangement in zip(axes[0, 1:], ARRANGEMENTS, strict=False):
        for label, r in results.items():
            if "robustness" not in r:
                continue
            x = r["robustness"][arrangement]
            line, = ax.plot(range(1, len(x["accuracy"]) + 1), x["accuracy"], "o-",
                            label=f"{label} (margin {x['margin']:.2f})")
            for v in (x["best"], x["worst"]):
                ax.axhline(v, color=line.get_color(), ls="--", lw=1)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set(xlabel="permutation seed", ylabel="accuracy", ylim=(-0.02, 1.02),
               title=f"Order robustness: {arrangement}")
        ax.legend(fontsize=8)
    save(fig, path)


register(Protocol("icl", run, applies, markdown=markdown, plot=plot))

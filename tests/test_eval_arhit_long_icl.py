"""Protocols ar_hit (Table 6 slices), long_context (Fig. 4) and icl (Figs. 6, 7) against independent expectations:
hand-written AR-Hit masks, losses recomputed in NumPy from the model's logits, a running mean of per-token losses,
label log-likelihoods from a full forward pass, and a hand-built model whose output favours one token."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import eval as eval_lib
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig
from diffjax.data import classification
from diffjax.data.pipeline import make_iterator
from diffjax.data.sources import DataError
from diffjax.eval import ar_hit, icl, long_context, position_loss
from diffjax.model import DecoderLM

ARCHS = [("diff", False), ("transformer", False), ("diff_v2", True)]  # the last one also scanned
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far")


def _model(arch: str, scan: bool) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=300, d_model=64, n_layers=2, n_heads=4 if arch == "transformer" else 2,
                       head_dim=16, dtype="float32", scan_layers=scan)


def _setup(arch, scan, rng, data: DataConfig):
    cfg = Config(model=_model(arch, scan), data=data).validate()
    init = jax.jit(DecoderLM(cfg.model).init)
    return cfg, init(jax.random.key(int(rng.integers(1 << 30))), jnp.zeros((1, 8), jnp.int32))["params"]


def _nll(model_cfg: ModelConfig, params, tokens, targets, positions=None, segment_ids=None) -> np.ndarray:
    """Per-token −log p(target) from the model's logits, log-softmax in float64 NumPy."""
    apply = jax.jit(DecoderLM(model_cfg).apply)
    logits = np.asarray(apply({"params": params}, jnp.asarray(tokens), positions, segment_ids), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def _paragraphs(rng, n: int, words: tuple[int, int]) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=rng.integers(*words))) for _ in range(n)]


# ------------------------------------------------------------------------------------------------------- ar_hit
def test_ar_hit_masks_of_hand_written_sequences():
    s = np.array([5, 6, 7, 5, 6, 8, 5, 6, 7])  # one document: bigram (5, 6) repeats at t=3, 6; (6, 7) at t=7
    one = np.ones((1, 8), int)
    assert ar_hit.ar_hit_mask(s[None, :-1], s[None, 1:], one).astype(int).tolist() == [[0, 0, 0, 1, 0, 0, 1, 1]]
    assert ar_hit.ar_hit_mask(s[None, :-1], s[None, 1:], one, n=3).astype(int).tolist() == [[0] * 7 + [1]]
    # two documents and padding: document 2 repeats document 1's bigram (1, 2) (not a hit), then its own
    tokens = [[1, 2, 1, 2, 1, 2, 3, 1, 0, 0]]
    targets = [[2, 1, 2, 9, 2, 3, 1, 2, 0, 0]]
    segments = [[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]]
    assert ar_hit.ar_hit_mask(tokens, targets, segments).astype(int).tolist() == [[0, 0, 1, 0, 0, 0, 0, 1, 0, 0]]
    # overlapping occurrences count: "4 4 4 4"
    assert ar_hit.ar_hit_mask([[4, 4, 4]], [[4, 4, 4]], [[1, 1, 1]]).astype(int).tolist() == [[0, 1, 1]]
    # a trigram needs two key tokens inside the document: none at a document's first position
    # (without the boundary, t=3 would repeat the trigram 7 8 7 that straddles it)
    assert ar_hit.ar_hit_mask([[7, 8, 7, 8, 7]], [[8, 7, 8, 7, 8]], [[1, 2, 2, 2, 2]], n=3).astype(int).tolist() == \
        [[0, 0, 0, 0, 1]]
    with pytest.raises(ConfigError, match="n >= 2"):
        ar_hit.ar_hit_mask([[1]], [[1]], [[1]], n=1)


def _brute_force_hits(tokens, targets, segments, n):
    hits = np.zeros(tokens.shape, bool)
    for b, t in np.ndindex(tokens.shape):
        if segments[b, t] == 0:
            continue
        same = segments[b] == segments[b, t]
        start = int(np.argmax(same & (np.arange(tokens.shape[1]) <= t)))  # first position of this run
        key = lambda u, b=b: (tuple(tokens[b, u - n + 2:u + 1]), targets[b, u])  # noqa: E731
        if t - n + 2 >= start:
            hits[b, t] = any(key(u) == key(t) for u in range(start + n - 2, t))
    return hits


@pytest.mark.parametrize("arch,scan", ARCHS)
def test_ar_hit_slices_equal_a_numpy_recomputation(arch, scan, rng, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(_paragraphs(rng, 40, (3, 30))))
    cfg, params = _setup(arch, scan, rng, DataConfig(source="text", path=str(path), seq_len=48, batch_size=4,
                                                     val_fraction=0.5))
    result = ar_hit.run(cfg, params, n=2, batches=2)

    it = make_iterator(cfg.data, split="val")
    losses, masks, hits = [], [], []
    for _ in range(2):
        b = it.next()
        losses.append(_nll(cfg.model, params, b["tokens"], b["targets"], b["positions"], b["segment_ids"]))
        masks.append(b["loss_mask"] > 0)
        hits.append(_brute_force_hits(b["tokens"], b["targets"], b["segment_ids"], 2))
    losses, mask, hit = np.concatenate(losses), np.concatenate(masks), np.concatenate(hits)
    assert 0 < (mask & hit).sum() < mask.sum()  # both slices are populated
    assert result["tokens"] == mask.sum()
    assert result["ar_hit_tokens"] == (mask & hit).sum() and result["others_tokens"] == (mask & ~hit).sum()
    np.testing.assert_allclose(result["loss"], losses[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(result["ar_hit_loss"], losses[mask & hit].mean(), rtol=1e-5)
    np.testing.assert_allclose(result["others_loss"], losses[mask & ~hit].mean(), rtol=1e-5)


def test_ar_hit_report(tmp_path):
    r = {"n": 2, "batches": 1, "loss": 3.0, "ar_hit_loss": 1.0, "others_loss": 3.5, "tokens": 10,
         "ar_hit_tokens": 2, "others_tokens": 8, "ar_hit_fraction": 0.2}
    table = eval_lib.get("ar_hit").markdown({"diff": r, "transformer": {**r, "ar_hit_loss": None}})
    assert "| Valid. loss | AR-Hit | Others |" in table and "| diff | 3.000 | 1.000 | 3.500 |" in table
    assert "| transformer | 3.000 | – | 3.500 |" in table
    eval_lib.get("ar_hit").plot({"diff": r}, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------ position_loss
def _by_hand(losses, seen, mask, edges):
    """Mean loss per [edges[i], edges[i + 1]) of tokens seen, one target at a time."""
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for loss, n, m in zip(losses.ravel(), seen.ravel(), mask.ravel(), strict=True):
        for i in range(len(edges) - 1):
            if m and edges[i] <= n < edges[i + 1]:
                sums[i] += loss
                counts[i] += 1
    return [s / c if c else float("nan") for s, c in zip(sums, counts, strict=True)], counts


def test_position_bins_give_back_a_planted_loss_per_position(rng, tmp_path, monkeypatch):
    """A model whose loss is planted as a function of the tokens seen: each bin is that function's mean over the
    bin's targets, and the bins are log-spaced and cover 1 .. seq_len."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(_paragraphs(rng, 60, (3, 40))))
    cfg, params = _setup("diff", False, rng, DataConfig(source="text", path=str(path), seq_len=64, batch_size=4,
                                                        val_fraction=0.5))
    scale = float(rng.uniform(0.5, 2.0))
    monkeypatch.setattr(position_loss, "training_token_losses",
                        lambda p, batch, cfg: scale * jnp.log1p(batch["positions"].astype(jnp.float32)))
    result = position_loss.run(cfg, params, bins=6, batches=3)
    assert result["edges"] == [1, 2, 4, 8, 16, 32, 65]
    it = make_iterator(cfg.data, split="val")
    batches = [it.next() for _ in range(3)]
    seen = np.concatenate([b["positions"] + 1 for b in batches])
    mask = np.concatenate([b["loss_mask"] > 0 for b in batches])
    expected, counts = _by_hand(scale * np.log(seen), seen, mask, result["edges"])
    assert result["tokens"] == counts and all(c > 0 for c in counts)
    np.testing.assert_allclose(result["loss"], expected, rtol=1e-5)


def test_position_bins_equal_a_numpy_recomputation_of_the_models_losses(rng, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(_paragraphs(rng, 40, (3, 30))))
    cfg, params = _setup("transformer", False, rng, DataConfig(source="text", path=str(path), seq_len=48,
                                                               batch_size=4, val_fraction=0.5))
    result = position_loss.run(cfg, params, bins=4, batches=2)
    it = make_iterator(cfg.data, split="val")
    losses, seen, mask = [], [], []
    for _ in range(2):
        b = it.next()
        losses.append(_nll(cfg.model, params, b["tokens"], b["targets"], b["positions"], b["segment_ids"]))
        seen.append(b["positions"] + 1)
        mask.append(b["loss_mask"] > 0)
    losses, seen, mask = np.concatenate(losses), np.concatenate(seen), np.concatenate(mask)
    expected, counts = _by_hand(losses, seen, mask, result["edges"])
    assert result["tokens"] == counts and sum(counts) == mask.sum()
    np.testing.assert_allclose(result["loss"], expected, rtol=1e-5)
    assert result["overall"] == pytest.approx(losses[mask].mean(), rel=1e-5)
    table = eval_lib.get("position_loss").markdown({"run": result})
    assert "| run | 1–2 | 3–6 | 7–18 | 19–48 | all |" in table  # bins named by the tokens seen, both ends included
    assert f"| run | {result['loss'][0]:.4f} |" in table
    eval_lib.get("position_loss").plot({"run": result}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------- long_context
@pytest.mark.parametrize("arch,scan", ARCHS)
def test_cumulative_nll_is_the_running_mean_of_token_losses(arch, scan, rng, tmp_path):
    length = 80  # bytes and tokens (one a byte), past the training length
    while True:  # redrawn until some paragraphs are long enough and some are skipped as too short
        paragraphs = _paragraphs(rng, 12, (2, 40))
        if 0 < sum(len(p.encode()) >= length for p in paragraphs) < 12:
            break
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs))
    cfg, params = _setup(arch, scan, rng, DataConfig(source="text", path=str(path), seq_len=32, batch_size=2))
    # sharper attention than at init, so positions (and RoPE θ) matter to the losses
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 8.0 if any(getattr(k, "key", None) in ("wq", "wk") for k in p) else x, nn.meta.unbox(params))
    result = long_context.run(cfg, params, length=length, n_docs=3, split="all", batch_size=2, points=16)

    long_enough = [p.encode() for p in paragraphs if len(p.encode()) >= length][:3]
    assert result["documents"] == len(long_enough) > 0
    docs = np.array([list(p[:length + 1]) + [256] * (length + 1 - len(p[:length + 1])) for p in long_enough])
    nll = _nll(cfg.model, params, docs[:, :-1], docs[:, 1:])
    expected = (np.cumsum(nll, axis=1) / np.arange(1, length + 1)).mean(axis=0)
    positions = np.array(result["positions"])
    assert positions[0] == 1 and positions[-1] == length and {1, 2, 4, 8, 16, 32, 64} <= set(positions.tolist())
    np.testing.assert_allclose(result["cumulative_nll"], expected[positions - 1], rtol=1e-5)
    assert result["final_nll"] == pytest.approx(expected[-1], rel=1e-5)

    # the RoPE θ override is applied (same as a model configured with it) and changes the result
    theta = 37.0
    other = long_context.run(cfg, params, length=length, n_docs=3, split="all", rope_theta=theta, points=16)
    assert other["rope_theta"] == theta and result["rope_theta"] == cfg.model.rope_theta
    nll_theta = _nll(dataclasses.replace(cfg.model, rope_theta=theta), params, docs[:, :-1], docs[:, 1:])
    expected_theta = (np.cumsum(nll_theta, axis=1) / np.arange(1, length + 1)).mean(axis=0)
    np.testing.assert_allclose(other["cumulative_nll"], expected_theta[positions - 1], rtol=1e-5)
    # θ moves the compared curve far past the tolerance, so the match above tells the two θ apart
    # (the final mean alone can land within 1e-4 of θ = 10,000's)
    assert np.abs(expected_theta - expected)[positions - 1].max() > 1e-3


def test_long_context_documents_and_errors(rng, tmp_path):
    path = tmp_path / "short.txt"
    paragraphs = _paragraphs(rng, 6, (2, 8))
    path.write_text("\n\n".join(paragraphs))
    cfg = Config(model=_model("diff", False), data=DataConfig(source="text", path=str(path), seq_len=32))
    longest = max(len(p.encode()) for p in paragraphs)
    with pytest.raises(DataError, match=f"at least 5000 tokens .*the longest has {longest} byte tokens"):
        long_context.long_documents(cfg, 5000, split="all")
    with pytest.raises(DataError, match="no such file"):
        long_context.long_documents(cfg, 8, path=str(tmp_path / "missing.txt"))
    # a JSONL corpus through eval.path; a document longer than the length keeps its next token, not EOS
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "abcdefghij"}) + "\n" + json.dumps({"text": "xy"}) + "\n")
    docs, _ = long_context.long_documents(cfg, 4, path=str(jsonl))
    assert docs.tolist() == [list(b"abcde")]
    docs, _ = long_context.long_documents(cfg, 10, path=str(jsonl))
    assert docs.tolist() == [list(b"abcdefghij") + [256]]
    # synthetic runs: validation examples joined by EOS, one document per row
    synth = Config(model=_model("diff", False), data=DataConfig(seq_len=64, tasks=("mqar",)))
    docs, _ = long_context.long_documents(synth, 150, n_docs=2)
    assert docs.shape == (2, 151) and (docs == 256).any()


def test_long_context_report(tmp_path):
    r = {"length": 8, "documents": 2, "rope_theta": 1e4, "train_seq_len": 4, "positions": [1, 2, 4, 8],
         "cumulative_nll": [5.0, 4.0, 3.0, 2.5], "final_nll": 2.5}
    table = long_context.markdown({"diff": r, "transformer": r})
    assert "| diff | 10000 | 2 | 5.000 | 4.000 | 3.000 | 2.500 |" in table
    long_context.plot({"diff": r}, tmp_path / "l.png")
    assert (tmp_path / "l.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------- icl
@pytest.mark.parametrize("arch,scan", ARCHS)
def test_cached_label_scores_equal_a_full_forward_pass(arch, scan, rng):
    cfg, params = _setup(arch, scan, rng, DataConfig(seq_len=64))
    prompt = rng.integers(0, 256, 77).tolist()  # 77 = 64 + 13: a full piece and a padded one
    candidates = [rng.integers(0, 256, k).tolist() for k in (1, 3, 2, 4)]
    scorer = icl.CachedScorer(cfg, params, max_len=96, label_batch=3)  # 4 labels: a padded second batch
    cache, _ = scorer.extend(scorer.empty(), prompt[:20])
    cache, next_logprobs = scorer.extend(cache, prompt[20:])
    scores = scorer.label_logprobs(cache, next_logprobs, candidates)
    # one full forward pass over prompt + each candidate (right-padded: causal, so padding changes nothing before)
    seqs = np.array([prompt + c + [0] * (4 - len(c)) for c in candidates])
    nll = _nll(cfg.model, params, seqs[:, :-1], seqs[:, 1:])
    expected = [-nll[i, len(prompt) - 1:len(prompt) - 1 + len(c)].sum() for i, c in enumerate(candidates)]
    np.testing.assert_allclose(scores, expected, rtol=1e-4)


def _favouring(cfg: Config, params, token: int):
    """Params whose logits favour `token` by 30 nats at every position: every layer zeroed (the residual stream
    is the embedding), all embeddings the unit vector e_0, and the head reading e_0 only into `token`."""
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if path[0].key in ("embed", "final_norm", "lm_head") else jnp.zeros_like(x),
        nn.meta.unbox(params))
    embed = np.zeros(params["embed"]["embedding"].shape, np.float32)
    embed[:, 0] = 1.0
    head = np.zeros(params["lm_head"]["kernel"].shape, np.float32)
    head[0, token] = 30.0 / np.sqrt(cfg.model.d_model)  # RMSNorm(e_0) = √d · e_0
    return {**params, "embed": {"embedding": jnp.asarray(embed)}, "lm_head": {"kernel": jnp.asarray(head)}}


def _labelled(rng, path, n: int):
    records = [{"text": " ".join(rng.choice(WORDS, size=3)), "label": str(rng.choice(["ab", "cd"]))} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


@pytest.mark.parametrize("arch,scan", ARCHS)
def test_icl_predicts_the_label_a_hand_built_model_prefers(arch, scan, rng, tmp_path, monkeypatch):
    records = _labelled(rng, tmp_path / "ab_cd.jsonl", 40)
    cfg, params = _setup(arch, scan, rng, DataConfig(seq_len=128))
    test, _ = icl.split(records, 8, seed=3)
    share_cd = np.mean([r["label"] == "cd" for r in test])
    orders = []
    arrange = icl.arrange
    monkeypatch.setattr(icl, "arrange", lambda labels, a, s: orders.append(arrange(labels, a, s)) or orders[-1])

    for token, expected in ((ord("c"), share_cd), (ord("a"), 1 - share_cd)):
        orders.clear()
        r = icl.run(cfg, _favouring(cfg, params, token), path=str(tmp_path / "ab_cd.jsonl"), shots=(1, 2, 1000),
                    n_test=8, seed=3, permutations=2, robust_shots=3)
        assert set(r["by_shots"]) == {"1", "2", str(r["cap"])}
        assert all(acc == pytest.approx(expected) for acc in r["by_shots"].values())
        for arrangement in icl.ARRANGEMENTS:
            assert r["robustness"][arrangement]["accuracy"] == [pytest.approx(expected)] * 2
            assert r["robustness"][arrangement]["margin"] == pytest.approx(0.0)
        # every permutation seed orders the same three demonstrations
        assert len(orders) == 4 and all(sorted(o) == [0, 1, 2] for o in orders)


def test_icl_cap_is_what_fits_the_context(rng, tmp_path):
    records = _labelled(rng, tmp_path / "ab_cd.jsonl", 30)
    cfg, params = _setup("diff", False, rng, DataConfig(seq_len=64))
    max_len = 150
    r = icl.run(cfg, params, path=str(tmp_path / "ab_cd.jsonl"), shots=(1, 64), n_test=5, seed=1, permutations=0,
                max_len=max_len)
    test, pool = icl.split(records, 5, seed=1)
    demo = [len(f"Input: {x['text']}\nLabel: {x['label']}\n".encode()) for x in pool]
    room = max_len - max(len(f"Input: {x['text']}\nLabel:".encode()) for x in test) - len(" ab\n")
    cap = max(k for k in range(len(pool) + 1) if sum(demo[:k]) <= room)
    assert r["cap"] == cap and set(r["by_shots"]) == {"1", str(cap)} and "robustness" not in r
    with pytest.raises(ConfigError, match="no room for one demonstration"):
        icl.run(cfg, params, path=str(tmp_path / "ab_cd.jsonl"), n_test=5, max_len=30)


def test_arrangements_reorder_the_same_demonstrations(rng):
    labels = [str(x) for x in rng.permutation(np.repeat(["p", "q", "r"], 5))]
    orders = {a: [icl.arrange(labels, a, [7, s]) for s in range(6)] for a in icl.ARRANGEMENTS}
    for per_seed in orders.values():
        assert all(sorted(o) == list(range(15)) for o in per_seed)  # a permutation: the same multiset
        assert len({tuple(o) for o in per_seed}) > 1  # seeds change the order
    for o in orders["alternating"]:  # balanced classes: one of each class in turn, in a fixed cycle
        seq = [labels[i] for i in o]
        assert sorted(seq[:3]) == ["p", "q", "r"] and all(seq[i] == seq[i % 3] for i in range(15))
    assert icl.arrange(labels, "random", 5) == icl.arrange(labels, "random", 5)
    with pytest.raises(ConfigError, match="unknown arrangement"):
        icl.arrange(labels, "sorted", 0)


def test_classification_files_and_errors(rng, tmp_path):
    a = classification.write_synthetic(tmp_path / "a.jsonl", 50, seed=4)
    b = classification.write_synthetic(tmp_path / "b.jsonl", 50, seed=4)
    assert a.read_bytes() == b.read_bytes()
    records = classification.load(a)
    for r in records:  # the label is the class of the text's one keyword
        found = [label for label, kws in classification.KEYWORDS.items() for w in r["text"].split() if w in kws]
        assert found == [r["label"]]
    assert len({r["label"] for r in records}) == 4

    cfg, params = _setup("transformer", False, rng, DataConfig(seq_len=64))
    with pytest.raises(DataError, match="missing.jsonl: no such classification file"):
        icl.run(cfg, params, path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    for lines, message in (([{"text": "x", "label": "a"}, {"text": "y"}], "bad.jsonl:2: no field 'label'"),
                           ([{"label": "a"}], "bad.jsonl:1: no field 'text'"),
                           ([{"text": "x", "label": ["a"]}], "bad.jsonl:1: field 'label' is list"),
                           ([{"text": "x", "label": "a"}, {"text": "y", "label": "a"}], "at least 2 labels")):
        bad.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with pytest.raises(DataError, match=message):
            icl.run(cfg, params, path=str(bad), n_test=1)
    bad.write_text('{"text": "x", "label": 1}\n{"text": \n')
    with pytest.raises(DataError, match="bad.jsonl:2: invalid JSON"):
        classification.load(bad)
    assert classification.load(tmp_path / "a.jsonl")[0].keys() == {"text", "label"}


def test_icl_on_the_synthetic_task_and_its_report(rng, tmp_path):
    cfg, params = _setup("diff", False, rng, DataConfig(seq_len=96))
    r = icl.run(cfg, params, shots=(1, 2), n_test=6, permutations=2, n_synthetic=40, max_len=256)
    assert r["labels"] == 4 and r["n_test"] == 6 and r["pool"] == 34
    assert all(0 <= v <= 1 for v in r["by_shots"].values())
    table = icl.markdown({"diff": r, "transformer": r})
    assert "| diff |" in table and "| transformer | alternating |" in table and "Input: <text>" in table
    icl.plot({"diff": r, "transformer": r}, tmp_path / "icl.png")
    assert (tmp_path / "icl.png").stat().st_size > 0

"""The "needle" (paper Table 2 / Fig. 5) and "attention_noise" (Table 3) protocols against NumPy recomputations,
hand-built attention maps and predictors, on tiny random models of every arch, scanned and unrolled."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from diffjax import eval as eval_lib
from diffjax.config import Config, ConfigError, DataConfig, ModelConfig
from diffjax.data.synthetic import DEPTHS, retrieval_examples
from diffjax.eval import attention_noise, needle
from diffjax.eval.attention_maps import attention_maps
from diffjax.model import DecoderLM, layer_lambdas


def _run(arch: str, rng, *, scan: bool = False, seq_len: int = 192, n_needles: int = 1, n_query: int = 1):
    model = ModelConfig(arch=arch, vocab_size=300, d_model=64, n_layers=2, n_heads=4 if arch == "transformer" else 2,
                        head_dim=16, dtype="float32", scan_layers=scan)
    cfg = Config(model=model, data=DataConfig(seq_len=seq_len, tasks=("retrieval",), n_needles=n_needles,
                                              n_query_cities=n_query, seed=int(rng.integers(1 << 20)))).validate()
    params = DecoderLM(model).init(jax.random.key(int(rng.integers(1 << 30))), jnp.zeros((1, 8), jnp.int32))
    return cfg, params["params"]


def _stack_layers(params, n_layers):
    """Unrolled `layer_i` parameters -> the scanned layout `layers/block` with a leading layer axis."""
    params = dict(nn.meta.unbox(params))
    layers = [params.pop(f"layer_{i}") for i in range(n_layers)]
    params["layers"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return params


# --- needle --------------------------------------------------------------------------------------------------


def test_needle_cell_equals_a_numpy_recomputation_on_a_random_model(rng):
    cfg, params = _run("diff", rng)
    n = 3
    r = needle.needle_eval(cfg, params, n=n, batch_size=2, needles=(1, 2), query_cities=(1, 2), lengths=(96, 192))
    forward = jax.jit(lambda b: DecoderLM(cfg.model).apply({"params": params}, b["tokens"], b["positions"],
                                                           b["segment_ids"]))
    predict, expected = needle.make_predict(cfg, 2), []
    for depth in DEPTHS:
        batch = retrieval_examples(cfg.data, n, depth=depth, n_needles=1, n_query_cities=1)
        logits = np.asarray(forward({k: batch[k] for k in ("tokens", "positions", "segment_ids")}))
        preds = logits.argmax(-1)
        # the chunked (2 + 1 padded), jitted predictions are the model's argmax (up to float near-ties)
        top2 = np.sort(logits, -1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 1e-4
        np.testing.assert_array_equal(predict(params, batch)[clear], preds[clear])
        expected.append(np.mean([np.all(p[m > 0] == t[m > 0]) for p, t, m in
                                 zip(preds, batch["targets"], batch["loss_mask"], strict=True)]))
    t2 = r["table2"]
    assert t2["accuracy"][0][0] == pytest.approx(np.mean(expected))
    assert t2["by_depth"][0][0] == pytest.approx(expected)
    assert t2["accuracy"][0][1] is None  # R > N: skipped
    assert t2["accuracy"][1][1] is None  # 2 needles and 2 questions need more than 192 bytes
    assert 0 <= t2["accuracy"][1][0] <= 1
    # the heatmap at the trained length is the same cell; length 96 cannot hold the task: a missing column
    assert r["heatmap"]["lengths"] == [96, 192]
    assert r["heatmap"]["mean"] == [None, pytest.approx(np.mean(expected))]
    assert [row[0] for row in r["heatmap"]["accuracy"]] == [None] * len(DEPTHS)
    assert any("N=2, R=2, length 192" in m for m in r["missing"])


def _fake_predict(passes):
    """A stand-in for the model: the targets, with the first answer token wrong where `passes(batch)` is False."""
    def make(cfg, batch_size):
        def predict(params, batch):
            preds = np.array(batch["targets"])
            rows = np.flatnonzero(~passes(batch))
            preds[rows, batch["answer_start"][rows, 0]] += 1
            return preds
        return predict
    return make


def test_needle_aggregates_hits_by_cell_depth_and_length(monkeypatch, rng):
    cfg, params = _run("transformer", rng, seq_len=400, n_needles=2)
    divisor = int(rng.integers(2, 5))

    def passes(batch):
        return batch["tokens"].astype(np.int64).sum(-1) % divisor != 0

    monkeypatch.setattr(needle, "make_predict", _fake_predict(passes))
    r = needle.needle_eval(cfg, params, n=6)
    t2 = r["table2"]
    assert t2["needles"] == [1, 2, 4, 6] and t2["query_cities"] == [1, 2]
    for i, k in enumerate(t2["needles"]):
        for j, q in enumerate(t2["query_cities"]):
            if q > k or (k, q) == (6, 2):  # skipped; 6 needles + 2 questions need up to 424 bytes
                assert t2["accuracy"][i][j] is None
                continue
            by_depth = [passes(retrieval_examples(cfg.data, 6, depth=d, n_needles=k, n_query_cities=q)).mean()
                        for d in DEPTHS]
            assert t2["by_depth"][i][j] == pytest.approx(by_depth)
            assert t2["accuracy"][i][j] == pytest.approx(np.mean(by_depth))
    # default lengths: 1/4..1 × 400 where 2 needles + 1 question (≤ 169 bytes) fit
    h = r["heatmap"]
    assert (h["n_needles"], h["n_query_cities"], h["lengths"]) == (2, 1, [200, 300, 400])
    assert any("default length 100" in m for m in r["missing"])
    for col, length in enumerate(h["lengths"]):
        by_depth = [passes(retrieval_examples(cfg.data, 6, depth=d, seq_len=length)).mean() for d in DEPTHS]
        assert [row[col] for row in h["accuracy"]] == pytest.approx(by_depth)
        assert h["mean"][col] == pytest.approx(np.mean(by_depth))


def test_a_perfect_model_scores_one_everywhere(monkeypatch, rng, tmp_path):
    cfg, params = _run("diff", rng, seq_len=320, n_needles=2, n_query=2)
    monkeypatch.setattr(needle, "make_predict", _fake_predict(lambda b: np.ones(len(b["tokens"]), bool)))
    r = needle.needle_eval(cfg, params, n=4, needles=(1, 2, 6), lengths=(260, 320, 480), allow_longer=True)
    acc = r["table2"]["accuracy"]
    assert acc == [[1.0, None], [1.0, 1.0], [None, None]]  # R > N; 6 needles do not fit in 320 bytes
    assert r["heatmap"]["mean"] == [1.0, 1.0, 1.0] and r["heatmap"]["lengths"] == [260, 320, 480]
    assert all(v == 1.0 for row in r["heatmap"]["accuracy"] for v in row)
    md = needle.markdown({"a": r, "b": r})
    assert "| N | a R=1 | a R=2 | b R=1 | b R=2 |" in md and "| 1 | 1.00 | — | 1.00 | — |" in md
    assert "| 6 | n/f | n/f | n/f | n/f |" in md
    needle.plot({"a": r, "b": r}, tmp_path / "needle.png")
    assert matplotlib.image.imread(tmp_path / "needle.png").ndim == 3


def test_needle_refuses_lengths_beyond_the_trained_one(rng):
    cfg, params = _run("diff", rng)
    with pytest.raises(ConfigError, match="exceed the trained data.seq_len 192"):
        needle.needle_eval(cfg, params, n=1, lengths=(128, 256))
    with pytest.raises(ConfigError, match="heatmap_query_cities"):
        needle.needle_eval(cfg, params, n=1, heatmap_needles=1, heatmap_query_cities=2)
    with pytest.raises(ConfigError, match="unknown option"):
        eval_lib.get("needle").parse_options(["eval.length=3"])
    assert eval_lib.get("needle").parse_options(["eval.lengths=64,128", "eval.allow_longer=true"]) == \
        {"lengths": (64, 128), "allow_longer": True}


# --- attention_noise -----------------------------------------------------------------------------------------


def _spans(rng, b, t):
    """Random query rows, answer span and context of `b` examples of length `t`."""
    ctx = rng.integers(t // 2, t - 4, b)
    ns = np.array([rng.integers(0, c - 2) for c in ctx])
    ne = np.array([rng.integers(s + 1, c + 1) for s, c in zip(ns, ctx, strict=True)])
    qs = np.array([rng.integers(c, t - 1) for c in ctx])
    qe = np.array([rng.integers(s + 1, t + 1) for s in qs])
    pos = np.arange(t)
    return ((pos >= qs[:, None]) & (pos < qe[:, None]), (pos >= ns[:, None]) & (pos < ne[:, None]),
            pos < ctx[:, None])


def test_all_mass_on_the_answer_span_gives_answer_share_one(rng):
    b, h, t = 3, 2, 24
    query, answer, context = _spans(rng, b, t)
    scale = rng.uniform(0.1, 1.0, (b, h, t, 1))  # a DIFF row sums to 1 − λ, not 1
    maps = rng.uniform(0.1, 1.0, (b, h, t, t)) * answer[:, None, None, :]
    maps = scale * maps / maps.sum(-1, keepdims=True)
    s = {k: np.asarray(v) for k, v in attention_noise.row_shares(maps, query, answer, context).items()}
    np.testing.assert_allclose(s["answer"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(s["noise"], 0.0, atol=1e-7)
    np.testing.assert_allclose(s["question"], 0.0, atol=1e-7)
    np.testing.assert_allclose(s["negative"], 0.0)
    expected_sum = [[scale[i, j, query[i], 0].mean() for j in range(h)] for i in range(b)]
    np.testing.assert_allclose(s["row_sum"], expected_sum, rtol=1e-6)


def test_shares_of_random_diff_maps_sum_to_one_and_match_numpy(rng):
    b, h, t = 4, 3, 20
    query, answer, context = _spans(rng, b, t)
    causal = np.tril(np.ones((t, t), bool))

    def softmax():
        logits = np.where(causal, rng.normal(0, 2, (b, h, t, t)), -np.inf)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    lam = rng.uniform(0.1, 0.9)
    while True:  # A1 − λ A2: rows sum to 1 − λ; redrawn until each head's query rows have negative entries
        maps = softmax() - lam * softmax()
        if all((maps[i][:, query[i]] < 0).any((-1, -2)).all() for i in range(b)):
            break
    s = {k: np.asarray(v) for k, v in attention_noise.row_shares(maps, query, answer, context).items()}
    np.testing.assert_allclose(s["answer"] + s["noise"] + s["question"], 1 + 2 * s["negative"], rtol=1e-5)
    np.testing.assert_allclose(s["row_sum"], 1 - lam, rtol=1e-5)
    for i in range(b):
        p = maps[i][:, query[i]]  # [H, Q, T]
        p = p / np.abs(p).sum(-1, keepdims=True)  # each row by its total absolute weight
        np.testing.assert_allclose(s["answer"][i], p[..., answer[i]].sum(-1).mean(-1), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(s["noise"][i], p[..., context[i] & ~answer[i]].sum(-1).mean(-1), rtol=1e-4,
                                   atol=1e-6)
        np.testing.assert_allclose(s["negative"][i], np.minimum(p, 0).sum(-1).mean(-1), rtol=1e-4, atol=1e-6)
        assert np.all(s["negative"][i] < 0)


@pytest.mark.parametrize("arch", ["diff", "diff_v2"])
def test_noise_shares_normalise_the_model_maps_by_their_absolute_row_sum(arch, rng):
    cfg, params = _run(arch, rng, n_needles=2)
    params = jax.tree.map(lambda x: 4.0 * x, nn.meta.unbox(params))  # sharper maps, so A1 − λA2 goes negative
    if arch == "diff":  # and λ ≈ 2 (exp(16 · 0.09) − 1 + λ_init), so it surely does, whatever the seed
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.full_like(x, 0.3) if "lambda_q1" in str(path) or "lambda_k1" in str(path) else
            jnp.zeros_like(x) if "lambda_q2" in str(path) or "lambda_k2" in str(path) else x, params)
    batch = retrieval_examples(cfg.data, 2, depth=float(rng.choice(DEPTHS)))
    got = attention_noise.noise_shares(cfg, params, batch, per_head=True)
    maps = attention_maps(cfg.model, params, batch["tokens"], batch["positions"], batch["segment_ids"])
    sums = maps.sum(-1, keepdims=True)  # [L, B, H, T, 1]
    if arch == "diff":  # one λ per layer: every row sums to 1 − λ
        lam = np.asarray(layer_lambdas(params, cfg.model))
        np.testing.assert_allclose(sums, np.broadcast_to((1 - lam)[:, None, None, None, None], sums.shape),
                                   atol=1e-5)
    norm = maps / np.abs(maps).sum(-1, keepdims=True)
    for i in range(2):
        rows = slice(batch["answer_start"][i, 0], batch["answer_end"][i, 0])
        span = slice(batch["needle_start"][i], batch["needle_end"][i])
        p = norm[:, i, :, rows]  # [L, H, Q, T]
        answer = p[..., span].sum(-1).mean(-1)
        context = p[..., :batch["context_len"][i]].sum(-1).mean(-1)
        np.testing.assert_allclose(got["answer"][i], answer, atol=1e-5)
        np.testing.assert_allclose(got["noise"][i], context - answer, atol=1e-5)
        np.testing.assert_allclose(got["question"][i], p.sum(-1).mean(-1) - context, atol=1e-5)
        np.testing.assert_allclose(got["negative"][i], np.minimum(p, 0).sum(-1).mean(-1), atol=1e-5)
        np.testing.assert_allclose(got["row_sum"][i], sums[:, i, :, rows, 0].mean(-1), atol=1e-5)
    assert got["negative"].min() < 0
    if arch == "diff":  # the scanned layout gives the same shares
        scan_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
        scanned = attention_noise.noise_shares(scan_cfg, _stack_layers(params, 2), batch, per_head=True)
        for k, v in got.items():
            np.testing.assert_allclose(scanned[k], v, atol=1e-5)


# --- both protocols on every arch ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch,scan", [("diff", False), ("transformer", False), ("diff_v2", False), ("diff", True)])
def test_both_protocols_run_on_every_arch(arch, scan, rng, tmp_path):
    cfg, params = _run(arch, rng, scan=scan, n_needles=2)
    assert eval_lib.get("needle").applies(cfg) and eval_lib.get("attention_noise").applies(cfg)
    r = eval_lib.get("needle").run(cfg, params, n=2, needles=(1, 2), query_cities=(1,))
    assert r["heatmap"]["lengths"] == [192]  # 48, 96, 144 cannot hold 2 needles (up to 169 bytes)
    assert all(0 <= a[0] <= 1 for a in r["table2"]["accuracy"])

    depths = (0.0, 0.5, 1.0)
    a = eval_lib.get("attention_noise").run(cfg, params, n=3, batch_size=2, depths=depths)
    for i, depth in enumerate(depths):  # the protocol chunks (2 + a padded 1); here: all 3 examples at once
        shares = attention_noise.noise_shares(cfg, params, retrieval_examples(cfg.data, 3, depth=depth))
        for k in attention_noise.SHARES:
            np.testing.assert_allclose(a["per_layer"][k][i], shares[k].mean(0), rtol=1e-5, atol=1e-7)
            assert a[k][i] == pytest.approx(shares[k].mean(), rel=1e-5, abs=1e-7)
    assert all(0 < x < 1 for x in a["answer"] + a["noise"])
    if arch == "transformer":
        np.testing.assert_allclose(a["per_layer"]["row_sum"], 1.0, atol=1e-5)
        assert a["negative"] == [0.0] * 3
    else:
        assert all(x <= 0 for x in a["negative"]) and all(0 < x < 1 for x in a["row_sum"])

    md = attention_noise.markdown({"x": a, "y": a})
    assert "| x | answer ↑ | " in md and "| y | noise ↓ | " in md and "| y | 1 | " in md
    attention_noise.plot({"x": a, "y": a}, tmp_path / "noise.png")
    assert matplotlib.image.imread(tmp_path / "noise.png").ndim == 3
    with pytest.raises(ConfigError, match="positive"):
        attention_noise.attention_noise(cfg, params, n=0)

"""Protocols "outliers" (Table 5) and "quantization" (Fig. 8): statistics against NumPy on the sown tensors,
the running top-k merge, the absmax quantizer's error bound and mask handling, the quantized kernel against the
reference, and both protocols on every arch (scanned layers give the unrolled results); a head-mixing fixture arch
read by its mixed logits."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures.archs import registered, talking_heads
from test_telemetry import numpy_stats, random_batch

from diffjax import config as config_lib
from diffjax import eval as eval_lib
from diffjax.config import ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.eval.outliers import TOPS, merge_top
from diffjax.eval.quantization import quantized_config
from diffjax.kernels import quantized, reference
from diffjax.model import DecoderLM, per_layer
from diffjax.train.telemetry import attention_stats

MQAR = ["data.seq_len=64", "data.batch_size=4", "data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6",
        "train.eval_batches=1"]


def tiny(arch: str, *overrides):
    return config_lib.load(f"configs/small.py:size=tiny,arch={arch}", [*MQAR, *overrides])


def init(cfg, rng, scale: float = 1.0):
    """Random params; `scale` > 1 enlarges the weights so the logits are far from zero (quantization bites)."""
    params = jax.jit(DecoderLM(cfg.model).init)(jax.random.key(int(rng.integers(1 << 30))), jnp.zeros((1, 8), int))
    return jax.tree.map(lambda x: x * scale, params["params"])


def stacked(params, n_layers: int) -> dict:
    """Unrolled `layer_{i}` params -> the scanned layout `layers/block` with a leading layer axis."""
    out = {k: v for k, v in params.items() if not k.startswith("layer_")}
    out["layers"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layer_{i}"]
                                                                          for i in range(n_layers)])}
    return out


# ----------------------------------------------------------------------------------------------- outliers
def numpy_outliers(cfg, params, budget: int, premix=None) -> dict:
    """All |logits| (causal, same document, budgeted queries) and |hidden| values, recomputed in float64; `premix`:
    each layer's [H, H] matrix mixing the logits across heads (talking heads: head h into head i by premix[h, i])."""
    data, seen, pools = make_iterator(cfg.data, split="val"), 0, {"attention_logits": [], "hidden_states": []}
    diff = cfg.model.arch in ("diff", "dint")  # two maps from sub-heads 2i, 2i+1 (both read kv group i // (h/kv))
    forward = jax.jit(lambda p, *xs: DecoderLM(cfg.model).apply({"params": p}, *xs, mutable=["intermediates"])[1])
    while seen < budget:
        batch = data.next()
        seg = np.asarray(batch["segment_ids"])
        take = np.zeros(seg.shape, bool)
        for idx in zip(*np.nonzero(seg > 0), strict=True):  # row-major: the first `budget` real tokens
            if seen < budget:
                take[idx], seen = True, seen + 1
        state = forward(params, batch["tokens"], batch["positions"], seg)
        t = seg.shape[1]
        mask = (np.arange(t)[:, None] >= np.arange(t)[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
        mask = (mask & take[:, :, None])[:, None]  # [B, 1, T, S]
        for i, layer in enumerate(per_layer(state["intermediates"], cfg.model)):
            q, k = (np.asarray(x, np.float64) for x in layer["attn"]["qk"][0])
            for qq, kk in ([(q[:, :, 0::2], k[:, :, 0::2]), (q[:, :, 1::2], k[:, :, 1::2])] if diff else [(q, k)]):
                kk = np.repeat(kk, qq.shape[2] // kk.shape[2], axis=2)
                logits = np.einsum("bthd,bshd->bhts", qq, kk) / np.sqrt(q.shape[-1])
                if premix is not None:
                    logits = np.einsum("bhts,hi->bits", logits, premix[i])
                pools["attention_logits"].append(np.abs(logits[np.broadcast_to(mask, logits.shape)]))
            pools["hidden_states"].append(np.abs(np.asarray(layer["hidden"][0], np.float64)[take]).ravel())
    data.close()
    return {kind: np.concatenate(v) for kind, v in pools.items()}


@pytest.mark.parametrize("arch,kv", [("diff", 1), ("transformer", 2), ("diff_v2", 1), ("dint", 1)])
def test_outlier_statistics_equal_numpy_on_packed_text(tmp_path, rng, arch, kv):
    """Packed documents (several per row, so same-document masking matters), a budget that ends mid-batch."""
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    docs = [" ".join(rng.choice(words, int(rng.integers(2, 12)))) for _ in range(200)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    cfg = tiny(arch, "data.source=text", f"data.path={tmp_path / 'corpus.txt'}", "data.val_fraction=0.3",
               f"model.n_kv_heads={kv}")
    params = init(cfg, rng, scale=float(rng.uniform(5, 20)))
    budget = int(rng.integers(300, 600))  # 256 tokens per batch: 2-3 batches, the last one cut
    # the transformer case reads the same token stream in rows of 2 (eval.batch_size): the same statistics
    result = eval_lib.get("outliers").run(cfg, params, tokens=budget, batch_size=2 if arch == "transformer" else 0)
    expected = numpy_outliers(cfg, params, budget)

    assert result["tokens"] == budget and result["median_exact"]
    for kind, values in expected.items():
        got, ordered = result[kind], np.sort(values)[::-1]
        assert got["count"] == values.size
        np.testing.assert_allclose([got["top"][str(k)] for k in TOPS], ordered[np.array(TOPS) - 1], rtol=1e-5)
        np.testing.assert_allclose(got["median"], np.median(values), rtol=1e-5)
    assert max(result["attention_logits"]["per_layer_max"]) == result["attention_logits"]["top"]["1"]


def test_a_head_mixing_arch_is_described_by_its_mixed_logits(rng):
    """Talking heads (tests/fixtures/archs) with its mixes off identity: telemetry's `entropy_a` / `max_logit_a`
    and the outliers' logits are the logits mixed across heads, recomputed here from the sown q, k and the mix in
    the params; the quantization protocol, which cannot reach logits computed outside a kernel op, refuses."""
    with registered(talking_heads.ARCH):
        cfg = tiny("talking_heads")
        h = cfg.model.n_heads
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x + 0.5 * rng.standard_normal((h, h)) if "mix" in jax.tree_util.keystr(path) else x,
            init(cfg, rng, scale=4.0))
        premix = [np.asarray(nn.meta.unbox(params)[f"layer_{i}"]["attn"]["pre_softmax_mix"], np.float64)
                  for i in range(cfg.model.n_layers)]
        result = eval_lib.get("outliers").run(cfg, params, tokens=300)
        expected = numpy_outliers(cfg, params, 300, premix)
        batch = random_batch(cfg, rng)
        stats = jax.jit(lambda p, b: attention_stats(p, b, cfg=cfg))(params, batch)
        _, state = jax.jit(lambda p, b: DecoderLM(cfg.model).apply(
            {"params": p}, b["tokens"], b["positions"], b["segment_ids"], mutable=["intermediates"]))(params, batch)
        with pytest.raises(ConfigError, match="arch 'talking_heads' computes its attention itself"):
            eval_lib.get("quantization").run(cfg, params)

    for kind, values in expected.items():
        np.testing.assert_allclose([result[kind]["top"][str(k)] for k in TOPS],
                                   np.sort(values)[::-1][np.array(TOPS) - 1], rtol=1e-5, err_msg=kind)
        np.testing.assert_allclose(result[kind]["median"], np.median(values), rtol=1e-5, err_msg=kind)
    for i, layer in enumerate(per_layer(state["intermediates"], cfg.model)):
        q, k = (np.asarray(x, np.float64) for x in layer["attn"]["qk"][0])
        logits = np.einsum("bthd,bshd->bhts", q, np.repeat(k, h // k.shape[2], axis=2)) / np.sqrt(q.shape[-1])
        for key, value in numpy_stats({"a": np.einsum("bhts,hi->bits", logits, premix[i])}, None,
                                      cfg.data.seq_len).items():
            np.testing.assert_allclose(float(stats[key][i]), value, rtol=2e-5, err_msg=f"{key} layer {i}")


def test_running_top_k_merge_equals_one_shot(rng):
    values = rng.standard_normal(int(rng.integers(500, 3000))).astype(np.float32) * 10
    cuts = np.sort(rng.choice(np.arange(1, values.size), size=int(rng.integers(1, 12)), replace=False))
    running = np.empty(0, np.float32)
    for chunk in np.split(values, cuts):
        running = merge_top(running, np.asarray(jax.lax.top_k(jnp.asarray(chunk), min(100, chunk.size))[0]))
    np.testing.assert_array_equal(running, np.sort(values)[::-1][:100])


# ----------------------------------------------------------------------------------------- the quantizer
@pytest.mark.parametrize("granularity", quantized.GRANULARITIES)
@pytest.mark.parametrize("bits", [4, 6])
def test_absmax_error_is_at_most_half_a_step_and_masked_entries_never_set_the_scale(rng, granularity, bits):
    b, h, t = 2, 3, 9
    x = (rng.standard_normal((b, h, t, t)) * rng.uniform(0.1, 30)).astype(np.float32)
    mask = np.tril(np.ones((t, t), bool))[None, None] & (rng.random((b, 1, t, t)) > 0.2)
    mask[..., 0] = True  # every row sees at least one key
    x = np.where(mask, x, 1e6 * np.sign(x))  # huge masked values: they would dominate any scale they entered
    xq = np.asarray(quantized.absmax_quantize(jnp.asarray(x), jnp.asarray(mask), bits=bits, granularity=granularity))

    axes = {"tensor": (0, 1, 2, 3), "head": (2, 3), "row": (3,)}[granularity]
    full = np.broadcast_to(mask, x.shape)
    scale = np.max(np.where(full, np.abs(x), 0), axis=axes, keepdims=True) / (2 ** (bits - 1) - 1)
    scale = np.broadcast_to(scale, x.shape)
    assert np.all(np.abs(xq - x)[full] <= scale[full] / 2 * (1 + 1e-5))
    levels = xq[full] / scale[full]
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)  # on the grid of the masked-in scale
    assert np.abs(np.round(levels)).max() <= 2 ** (bits - 1) - 1
    np.testing.assert_array_equal(xq[~full], x[~full])  # masked entries untouched (the softmax masks them)


def _qkv(rng, b=2, t=12, h=4, kv=2, d=8, e=16, spread=3.0):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)) * spread, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kv, d)) * spread, jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kv, e)), jnp.float32)
    seg = jnp.asarray(np.broadcast_to((np.arange(t) >= int(rng.integers(2, t - 2))) + 1, (b, t)))
    return q, k, v, seg


@pytest.mark.parametrize("granularity", quantized.GRANULARITIES)
def test_quantized_kernels_at_many_bits_equal_the_reference(rng, granularity):
    q, k, v, seg = _qkv(rng)
    out = quantized.attention(q, k, v, causal=True, segment_ids=seg, bits=24, granularity=granularity)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True, segment_ids=seg), atol=2e-5)
    q2, k2, _, _ = _qkv(rng)
    lam = jnp.float32(rng.uniform(0.2, 0.8))
    out = quantized.diff_attention(q, q2, k, k2, v, lam, causal=True, segment_ids=seg, bits=24,
                                   granularity=granularity)
    np.testing.assert_allclose(out, reference.diff_attention(q, q2, k, k2, v, lam, causal=True, segment_ids=seg),
                               atol=2e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_quantized_diff_kernel_at_4_bits_equals_numpy(rng, shared):
    """Each map quantized with its own per-row scale (or both by the larger, `shared`), then softmax, A1 − λA2,
    times V (GQA groups). The inputs are
    redrawn until no logit lies within 3e-5 of a rounding boundary (x / scale at a half-integer), where float32's
    ~2e-6 error in x / scale could pick the other 4-bit level than this float64 oracle."""
    def levels(q, k, mask):  # [B, H, T, S] x / scale, and the scale
        q, k = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=2)
        x = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
        scale = np.max(np.where(mask, np.abs(x), 0), axis=-1, keepdims=True) / 7
        return x / scale, scale

    def probs(level, scale, mask):
        x = np.where(mask, np.round(level) * scale, -np.inf)
        p = np.exp(x - x.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    while True:
        (q1, k1, v, seg), (q2, k2, _, _) = _qkv(rng), _qkv(rng)
        seg_np, t = np.asarray(seg), q1.shape[1]
        mask = (np.tril(np.ones((t, t), bool))[None] & (seg_np[:, :, None] == seg_np[:, None, :]))[:, None]
        maps = [levels(q1, k1, mask), levels(q2, k2, mask)]
        if shared:
            scale = np.maximum(maps[0][1], maps[1][1])
            maps = [(level * s / scale, scale) for level, s in maps]
        if all(np.all(np.abs(level - np.floor(level) - 0.5)[np.broadcast_to(mask, level.shape)] > 3e-5)
               for level, _ in maps):
            break
    lam = float(rng.uniform(0.2, 0.8))
    a1, a2 = (probs(level, scale, mask) for level, scale in maps)
    expected = np.einsum("bhts,bshe->bthe", a1 - lam * a2, np.repeat(np.asarray(v), 2, 2))
    out = quantized.diff_attention(q1, q2, k1, k2, v, jnp.float32(lam), causal=True, segment_ids=seg, bits=4,
                                   granularity="row", shared_scale=shared)
    np.testing.assert_allclose(out, expected, atol=2e-5)


# -------------------------------------------------------------------------------------------- quantization
def test_16_bits_is_exactly_the_unquantized_model(rng):
    cfg = tiny("diff")
    params = init(cfg, rng, scale=10.0)
    assert quantized_config(cfg, 16, "row") is cfg
    result = eval_lib.get("quantization").run(cfg, params, bits=(16, 4), granularity="row", eval_batches=2)
    for i, bits in enumerate((16, 4)):  # cross-entropy in float64 NumPy on the model's logits
        model = DecoderLM(quantized_config(cfg, bits, "row").model)
        logits_fn = jax.jit(lambda p, b, model=model: model.apply({"params": p}, b["tokens"], b["positions"],
                                                                  b["segment_ids"]))
        data, total, count = make_iterator(cfg.data, split="val"), 0.0, 0.0
        for _ in range(2):
            batch = data.next()
            logits = np.asarray(logits_fn(params, batch), np.float64)
            top = logits.max(-1, keepdims=True)
            log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
            nll = log_z - np.take_along_axis(logits, batch["targets"][..., None].astype(int), -1)[..., 0]
            total += float(np.sum(nll * batch["loss_mask"]))
            count += float(batch["loss_mask"].sum())
        data.close()
        np.testing.assert_allclose(result["val_loss"][i], total / count, rtol=1e-5)
    assert abs(result["val_loss"][1] - result["val_loss"][0]) > 1e-4  # 4-bit logits of large weights change it


@pytest.mark.parametrize("arch,scan,granularity", [("diff", True, "row"), ("transformer", False, "tensor"),
                                                   ("diff_v2", False, "head")])
def test_protocols_run_for_every_arch_and_scanned_layers_match(tmp_path, rng, arch, scan, granularity):
    """Both protocols on each arch; the scan case also runs the unrolled model and compares."""
    retrieval = arch == "transformer"  # one case on retrieval data: the accuracy column
    extra = ["data.tasks=retrieval,mqar", "data.seq_len=192", "data.n_needles=2"] if retrieval else []
    cfg = tiny(arch, *extra)
    params = init(cfg, rng, scale=8.0)
    options = {"bits": (16, 4), "granularity": granularity, "retrieval_n": 2,
               "seed": 1}
    outliers = eval_lib.get("outliers").run(cfg, params, tokens=300)
    expected = numpy_outliers(cfg, params, 300)  # synthetic rows, one document each
    quant = eval_lib.get("quantization").run(cfg, params, **options)
    if scan:
        scanned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
        params = stacked(params, cfg.model.n_layers)
        scanned_outliers = eval_lib.get("outliers").run(scanned, params, tokens=300)
        np.testing.assert_allclose(jax.tree.leaves(scanned_outliers), jax.tree.leaves(outliers), rtol=1e-5)
        scanned_quant = eval_lib.get("quantization").run(scanned, params, **options)
        np.testing.assert_allclose(scanned_quant["val_loss"], quant["val_loss"], rtol=1e-5)

    assert quant["bits"] == [16, 4] and len(quant["val_loss"]) == 2 and np.all(np.isfinite(quant["val_loss"]))
    assert ("retrieval_accuracy" in quant) == retrieval
    assert outliers["tokens"] == 300
    for kind, values in expected.items():
        np.testing.assert_allclose([outliers[kind]["top"][str(k)] for k in TOPS],
                                   np.sort(values)[::-1][np.array(TOPS) - 1], rtol=1e-5)
        np.testing.assert_allclose(outliers[kind]["median"], np.median(values), rtol=1e-5)
    for name, result in (("outliers", outliers), ("quantization", quant)):
        protocol = eval_lib.get(name)
        table = protocol.markdown({"a": result, "b": result})
        assert table.count("\n| ") >= 3 and "a" in table
        protocol.plot({"a": result, "b": result}, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_bad_requests_and_cli_options():
    cfg = tiny("diff")
    with pytest.raises(ConfigError, match="tokens"):
        eval_lib.get("outliers").run(cfg, {}, tokens=0)
    with pytest.raises(ConfigError, match="bits"):
        eval_lib.get("quantization").run(cfg, {}, bits=(8, 1))
    with pytest.raises(ConfigError, match="granularity"):
        eval_lib.get("quantization").run(cfg, {}, granularity="column")
    assert eval_lib.get("quantization").parse_options(["eval.bits=16,8", "eval.granularity=head",
                                                       "eval.shared_scale=true"]) == {
        "bits": (16, 8), "granularity": "head", "shared_scale": True}


def numpy_map_errors(cfg, params, bits: int, granularity: str, shared: bool) -> tuple[list, list, list]:
    """Per layer (‖Q(P) − P‖ / ‖P‖, ‖(Q(P) − P) V‖ / ‖P V‖, ‖Q(A) − A‖ / ‖A‖ over the softmax maps) on the first
    validation batch, in
    float64: DIFF's maps from sub-heads 2i / 2i+1 of q and k, DIFF V2's from query heads 2i / 2i+1 (one op call: a
    per-tensor scale spans both), P = A1 − λA2 with λ per head (DIFF) or per token (V2)."""
    data = make_iterator(cfg.data, split="val")
    batch = data.next()
    data.close()
    forward = jax.jit(lambda p, *xs: DecoderLM(cfg.model).apply({"params": p}, *xs, mutable=["intermediates"])[1])
    state = forward(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    seg, arch = np.asarray(batch["segment_ids"]), cfg.model.arch
    t = seg.shape[1]
    mask = ((np.arange(t)[:, None] >= np.arange(t)[None, :])[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
    rows = (seg > 0)[:, None, :, None]
    axes = {"tensor": (0, 1, 2, 3), "head": (2, 3), "row": (3,)}[granularity]
    out = ([], [], [])
    for layer in per_layer(state["intermediates"], cfg.model):
        q, k = (np.asarray(x, np.float64) for x in layer["attn"]["qk"][0])
        pairs = {"diff": [(q[:, :, 0::2], k[:, :, 0::2]), (q[:, :, 1::2], k[:, :, 1::2])],
                 "diff_v2": [(q[:, :, 0::2], k), (q[:, :, 1::2], k)]}.get(arch, [(q, k)])
        logits = [np.einsum("bthd,bshd->bhts", qq, np.repeat(kk, qq.shape[2] // kk.shape[2], axis=2))
                  / np.sqrt(q.shape[-1]) for qq, kk in pairs]
        amax = [np.max(np.where(mask, np.abs(x), 0), axis=axes, keepdims=True) for x in logits]
        if shared or arch == "diff_v2":  # V2's maps share a group only where it spans heads
            joint = np.maximum(*amax) if arch == "diff" or granularity == "tensor" else None
            amax = amax if joint is None else [joint] * 2
        softmax = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(  # noqa: E731
            -1, keepdims=True)
        exact = [softmax(np.where(mask, x, -np.inf)) for x in logits]
        step = [a / (2 ** (bits - 1) - 1) for a in amax]
        quant = [softmax(np.where(mask, np.round(x / s) * s, -np.inf)) for x, s in zip(logits, step, strict=True)]
        if len(exact) == 2:
            lam = np.asarray(layer["attn"]["lambda"][0], np.float64)
            lam = lam.reshape(1, -1, 1, 1) if arch == "diff" else np.transpose(lam, (0, 2, 1))[..., None]
            p, pq = exact[0] - lam * exact[1], quant[0] - lam * quant[1]
        else:
            p, pq = exact[0], quant[0]
        norm = lambda x: np.sqrt(np.sum(np.where(rows, x, 0) ** 2))  # noqa: E731
        v = np.asarray(layer["attn"]["v"][0], np.float64)
        v = np.repeat(v, p.shape[1] // v.shape[2], axis=2)
        out[0].append(norm(pq - p) / norm(p))
        out[1].append(norm(np.einsum("bhts,bshe->bhte", pq - p, v)) / norm(np.einsum("bhts,bshe->bhte", p, v)))
        out[2].append(np.sqrt(sum(norm(a - b) ** 2 for a, b in zip(quant, exact, strict=True))
                              / sum(norm(a) ** 2 for a in exact)))
    return out


@pytest.mark.parametrize("arch,granularity,shared", [("diff", "row", True), ("diff", "tensor", False),
                                                     ("transformer", "head", False), ("diff_v2", "tensor", False)])
def test_map_errors_equal_numpy(rng, arch, granularity, shared):
    """The protocol's per-layer error of the quantized attention map against float64 NumPy (4 bits, where levels
    are coarse: a logit within float32 error of a rounding boundary moves one entry, not the norm's 3 digits)."""
    cfg = tiny(arch, "model.n_kv_heads=1")
    params = init(cfg, rng, scale=float(rng.uniform(4, 10)))
    result = eval_lib.get("quantization").run(cfg, params, bits=(16, 4), granularity=granularity,
                                              shared_scale=shared)
    expected = numpy_map_errors(cfg, params, 4, granularity, shared)
    for name, errors in zip(("map_error", "output_error", "softmax_error"), expected, strict=True):
        assert result[name][0] == [0.0] * cfg.model.n_layers, name  # 16 bits: exact
        np.testing.assert_allclose(result[name][1], errors, rtol=2e-3, err_msg=name)
    assert (result["lambda"][0] is None) == (arch == "transformer")

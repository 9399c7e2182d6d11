"""The baseline archs `gated`, `sink` and `dint` (docs/design.md §2) against float64 NumPy oracles written here from
their papers' equations, forward and backward (central finite differences of the oracle along a random direction
of every parameter and of the input), with GQA; their attention maps; FLOP counts; config errors; the impls they take;
a few training steps. What every arch must do (decoding, causality, matching, …): tests/test_arch_conformance.py.

The oracles share no code with diffjax: projections, rotary embeddings, softmaxes, gates, sinks, λ, the integral
term and the head norm are re-derived in NumPy.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from helpers import losses

from diffjax import checks, flops, kernels, recipes
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError, ModelConfig
from diffjax.kernels import reference
from diffjax.model import DecoderLM, archs, param_count
from diffjax.model.archs import dint as dint_arch
from diffjax.summary import summary
from diffjax.train.loop import train

B, T, D_MODEL, HD = 2, 9, 32, 8  # batch, length, d_model, head dim
LAMBDA_INIT = 0.8 - 0.6 * np.exp(-0.3)  # layer 2 of the schedule


# ------------------------------------------------------------------------------------------------ the oracles
def rope(x, pos, theta=10_000.0):
    """Rotate-half RoPE on the last dim of x [B, T, N, d] at integer positions [B, T]."""
    d = x.shape[-1]
    ang = pos[:, :, None, None] * theta ** (-np.arange(0, d, 2) / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def visible(seg):
    """[B, T, S]: query t sees key s (s ≤ t, same document)."""
    return np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])


def softmax_visible(s, allowed):
    e = np.where(allowed, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)


def gated_oracle(p, x, pos, seg, h, n_kv, gate):
    """Y_i = softmax(Q_i K_gᵀ/√d) V_g ⊙ σ(x W_g)_i (one scalar per head and token, or one per channel), then W_O."""
    q = rope((x @ p["wq/kernel"]).reshape(B, T, h, HD), pos)
    k = rope((x @ p["wk/kernel"]).reshape(B, T, n_kv, HD), pos)
    v = (x @ p["wv/kernel"]).reshape(B, T, n_kv, HD)
    g = sigmoid(x @ p["w_gate/kernel"]).reshape(B, T, h, HD if gate == "elementwise" else 1)
    allowed, heads, maps = visible(seg), [], []
    for i in range(h):
        grp = i // (h // n_kv)
        a = softmax_visible(np.einsum("btd,bsd->bts", q[:, :, i], k[:, :, grp]) / np.sqrt(HD), allowed)
        heads.append(np.einsum("bts,bse->bte", a, v[:, :, grp]) * g[:, :, i])  # the gate, before W_O
        maps.append(a)
    return np.concatenate(heads, -1) @ p["wo/kernel"], np.stack(maps, 1)


def sink_oracle(p, x, pos, seg, h, n_kv):
    """p_ts = exp(s_ts) / (exp(sink_i) + Σ_visible exp(s_ts')), O_i = p V_g, then W_O."""
    q = rope((x @ p["wq/kernel"]).reshape(B, T, h, HD), pos)
    k = rope((x @ p["wk/kernel"]).reshape(B, T, n_kv, HD), pos)
    v = (x @ p["wv/kernel"]).reshape(B, T, n_kv, HD)
    allowed, heads, maps = visible(seg), [], []
    for i in range(h):
        grp = i // (h // n_kv)
        e = np.where(allowed, np.exp(np.einsum("btd,bsd->bts", q[:, :, i], k[:, :, grp]) / np.sqrt(HD)), 0.0)
        a = e / (np.exp(p["sinks"][i]) + e.sum(-1, keepdims=True))
        heads.append(np.einsum("bts,bse->bte", a, v[:, :, grp]))
        maps.append(a)
    return np.concatenate(heads, -1) @ p["wo/kernel"], np.stack(maps, 1)


def dint_oracle(p, x, pos, seg, h, n_kv, headwise_norm, eps=1e-5):
    """(A1 − λ A2 + λ G) V per head with G[t] = the mean of A1's rows r ≤ t of t's document (the paper's column mean
    over the prefix t has seen), DIFF's λ, headwise RMSNorm · (1 − λ_init), W_O."""
    q = rope((x @ p["wq/kernel"]).reshape(B, T, 2 * h, HD), pos)  # sub-heads (2i, 2i+1) = (Q1_i, Q2_i)
    k = rope((x @ p["wk/kernel"]).reshape(B, T, 2 * n_kv, HD), pos)
    v = (x @ p["wv/kernel"]).reshape(B, T, n_kv, 2 * HD)
    lam = np.exp(p["lambda_q1"] @ p["lambda_k1"]) - np.exp(p["lambda_q2"] @ p["lambda_k2"]) + LAMBDA_INIT
    allowed, heads, maps = visible(seg), [], []
    for i in range(h):
        grp = i // (h // n_kv)
        a1, a2 = (softmax_visible(np.einsum("btd,bsd->bts", q[:, :, 2 * i + half], k[:, :, 2 * grp + half])
                                  / np.sqrt(HD), allowed) for half in (0, 1))
        g = np.zeros_like(a1)
        for b in range(B):
            for t in range(T):
                rows = [r for r in range(t + 1) if seg[b, r] == seg[b, t]]
                g[b, t] = a1[b, rows].mean(0)
        a = a1 - lam * a2 + lam * g
        o = np.einsum("bts,bse->bte", a, v[:, :, grp])
        if headwise_norm:
            o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * p["head_norm/scale"] * (1 - LAMBDA_INIT)
        heads.append(o)
        maps.append(a)
    return np.concatenate(heads, -1) @ p["wo/kernel"], np.stack(maps, 1)


# ------------------------------------------------------------------------------------------ layer vs oracle
CASES = {  # name: (arch, heads, kv heads, config fields, oracle)
    "gated_headwise_gqa": ("gated", 4, 2, {"gate": "headwise"},
                           lambda p, x, pos, seg: gated_oracle(p, x, pos, seg, 4, 2, "headwise")),
    "gated_elementwise": ("gated", 4, 4, {"gate": "elementwise"},
                          lambda p, x, pos, seg: gated_oracle(p, x, pos, seg, 4, 4, "elementwise")),
    "gated_elementwise_gqa": ("gated", 4, 1, {"gate": "elementwise"},
                              lambda p, x, pos, seg: gated_oracle(p, x, pos, seg, 4, 1, "elementwise")),
    "sink": ("sink", 4, 4, {}, lambda p, x, pos, seg: sink_oracle(p, x, pos, seg, 4, 4)),
    "sink_gqa": ("sink", 4, 2, {}, lambda p, x, pos, seg: sink_oracle(p, x, pos, seg, 4, 2)),
    "dint": ("dint", 2, 2, {}, lambda p, x, pos, seg: dint_oracle(p, x, pos, seg, 2, 2, True)),
    "dint_gqa_no_norm": ("dint", 4, 2, {"headwise_norm": False},
                         lambda p, x, pos, seg: dint_oracle(p, x, pos, seg, 4, 2, False)),
}


def _flat(tree) -> dict:
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _inputs(rng):
    """x [B, T, D], positions, segment ids: row 0 packs two documents (positions restart), row 1 is one."""
    x = rng.normal(size=(B, T, D_MODEL)).astype(np.float32)
    cut = int(rng.integers(2, T - 2))
    seg = np.stack([np.where(np.arange(T) < cut, 1, 2), np.ones(T, int)])
    pos = np.stack([np.where(np.arange(T) < cut, np.arange(T), np.arange(T) - cut), np.arange(T)])
    return x, pos, seg


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_float64_oracle_forward_backward_and_map(case, rng):
    arch_name, h, n_kv, fields, oracle = CASES[case]
    cfg = ModelConfig(arch=arch_name, vocab_size=64, d_model=D_MODEL, n_layers=2, n_heads=h, head_dim=HD,
                      n_kv_heads=n_kv, dtype="float32", **fields)
    checks.check_model(cfg)
    arch = archs.get(arch_name)
    x, pos, seg = _inputs(rng)
    module = arch.layer(cfg)
    args = (jnp.float32(LAMBDA_INIT), jnp.asarray(pos), jnp.asarray(seg))
    # Fresh random values everywhere (sinks of order 1, so they take a visible share of each row): the layer's init
    # gives only the shapes.
    shapes = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), jnp.asarray(x), *args)["params"])
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(rng.normal(size=a.shape) * (1.0 if path[-1].key == "sinks" else 0.3),
                                    jnp.float32), shapes)
    mask = reference.make_mask(B, T, T, causal=True, segment_ids=jnp.asarray(seg))
    r = rng.normal(size=(B, T, D_MODEL))  # the direction of the backward check below (the output's shape)

    @jax.jit  # one program: the output, the map from what the layer sowed, the gradients
    def forward(params, x, args, mask, r):
        out, inter = module.apply({"params": params}, x, *args, mutable=["intermediates"])
        sown = {name: value[0] for name, value in inter["intermediates"].items()}

        def loss(params, x):
            return jnp.sum(module.apply({"params": params}, x, *args) * r)

        return out, arch.attention_map(cfg, sown, mask), jax.grad(loss, argnums=(0, 1))(params, x)

    out, got, (g_params, g_x) = forward(params, jnp.asarray(x), args, mask, jnp.asarray(r, jnp.float32))
    p64 = {name: np.asarray(leaf, np.float64) for name, leaf in _flat(params).items()}
    expected, maps = oracle(p64, x.astype(np.float64), pos, seg)
    assert expected.shape == r.shape
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-4, atol=2e-4 * scale)

    # The attention map the evals read (what multiplies V) from what the layer sowed.
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, maps, atol=2e-5)
    rows = got.sum(-1)
    if arch_name == "dint":
        np.testing.assert_allclose(rows, 1.0, atol=2e-5)  # the integral term restores row sums of 1
    elif arch_name == "sink":
        # the sink takes a share of every row (in float32 a row whose sink logit is far below its keys' sums to 1)
        assert np.all(rows <= 1.0 + 1e-6) and np.all(rows > 0) and rows.min() < 0.9, rows

    # Backward: the layer's gradient of Σ out·R along a random direction of every leaf (and of x) against central
    # finite differences of the float64 oracle.
    grads = {name: np.asarray(g, np.float64) for name, g in _flat(g_params).items()} | {"x": np.asarray(g_x)}

    def oracle_loss(p, x):
        return float(np.sum(oracle(p, x, pos, seg)[0] * r))

    eps = 1e-5
    for name, g in grads.items():
        u = rng.normal(size=g.shape)
        plus, minus = (({**p64, name: p64[name] + s * eps * u}, x) if name != "x" else (p64, x + s * eps * u)
                       for s in (1, -1))
        fd = (oracle_loss(*plus) - oracle_loss(*minus)) / (2 * eps)
        got = float(np.sum(g * u))
        assert abs(got - fd) <= 2e-3 * abs(fd) + 1e-4 * np.linalg.norm(g) * np.linalg.norm(u), (name, got, fd)


# ------------------------------------------------------------------------------------------------ the model
MODELS = {  # name: (arch, heads, kv heads, config fields)
    "gated_headwise": ("gated", 4, 2, {}),
    "gated_elementwise": ("gated", 4, 2, {"gate": "elementwise"}),
    "sink": ("sink", 4, 2, {}),
    "dint": ("dint", 2, 1, {}),
}


def _model(name, **kw):
    arch, heads, kv, fields = MODELS[name]
    cfg = ModelConfig(arch=arch, vocab_size=300, d_model=64, n_layers=2, n_heads=heads, n_kv_heads=kv, head_dim=16,
                      dtype="float32", **fields, **kw)
    return checks.check_model(cfg)


def test_elementwise_match_at_paper_sizes_keeps_the_head_dim():
    h = {"830M": 8, "1.4B": 8, "2.8B": 10, "6.8B": 16, "13.1B": 20, "3B": 12}
    for size, heads in {"830M": 13, "1.4B": 13, "2.8B": 16, "6.8B": 26, "13.1B": 32, "3B": 19}.items():
        m = recipes.model_config(size, "gated", gate="elementwise")
        assert (m.n_heads, m.head_dim) == (heads, recipes.PAPER_SIZES[size][3])
        # attention weights within 2 % of DIFF's 8·d_model·h·d
        assert abs(flops.attention_params(m) / (8 * m.d_model * h[size] * m.head_dim) - 1) < 0.02


def test_flop_counts():
    n, base = 256, _model("gated_headwise")
    standard = archs.standard_attention_flops(4, 16, n, True, True)
    assert flops.attention_flops(base, n) == flops.attention_flops(_model("sink"), n) == standard
    dint = _model("dint")
    # the DIFF op (12 + 20) and the standard op for A1 V with V of 2d (6 + 14)
    assert flops.attention_flops(dint, n) == (18 + 34) * 2 * n**2 * 16 * 0.5
    assert flops.attention_flops(dint, n, backward=False) == 18 * 2 * n**2 * 16 * 0.5
    d, hd, h = 64, 16, 4  # the elementwise gate is a fifth matmul: d_model × H·d
    assert flops.matmul_params(_model("gated_elementwise")) - flops.matmul_params(base) == 2 * (d * h * hd - d * h)
    # DINT's matmul weights are DIFF's: W_Q, W_O d_model × 2h·d and W_K, W_V d_model × 2·kv·d (h = 2, kv = 1)
    assert flops.attention_params(dint) == flops.attention_params(dataclasses.replace(dint, arch="diff")) == \
        4 * d * hd * (2 + 1)


# Matmul weights of one attention layer by hand, d_model × (channels of W_Q + W_K + W_V + W_O + the arch's own
# projections), for H heads of d with K kv heads: what FLOP counting takes (flops.attention_params derives it from
# the layer's parameters; norm scales, λ vectors and sink logits are elementwise and not counted).
ATTENTION_WEIGHTS = {
    "diff": lambda H, K, d, gate: (2 * H * d) + (2 * K * d) + (2 * K * d) + (2 * H * d),  # Q, K as 2H / 2K of d
    "dint": lambda H, K, d, gate: (2 * H * d) + (2 * K * d) + (2 * K * d) + (2 * H * d),  # DIFF's parameters
    "transformer": lambda H, K, d, gate: H * d + K * d + K * d + H * d,
    "sink": lambda H, K, d, gate: H * d + K * d + K * d + H * d,
    "diff_v2": lambda H, K, d, gate: 2 * H * d + K * d + K * d + H * d + H,  # 2H query heads; W_λ: H
    "gated": lambda H, K, d, gate: H * d + K * d + K * d + H * d + (H * d if gate == "elementwise" else H),  # W_g
}


@pytest.mark.parametrize("arch", sorted(ATTENTION_WEIGHTS))
@pytest.mark.parametrize("heads,kv,head_dim,headwise_norm,gate", [
    (4, None, 16, None, None), (6, 2, 8, True, "headwise"), (4, 2, 24, False, "elementwise"), (4, 1, 8, True, None)])
def test_attention_params_are_the_matmul_weights(arch, heads, kv, head_dim, headwise_norm, gate):
    spec = archs.get(arch)
    cfg = ModelConfig(arch=arch, vocab_size=300, d_model=48, n_layers=3, n_heads=heads, n_kv_heads=kv,
                      head_dim=head_dim, headwise_norm=None if spec.headwise_norm is None else headwise_norm,
                      gate=gate if spec.gates else None)
    weights = 48 * ATTENTION_WEIGHTS[arch](heads, kv or heads, head_dim, archs.gate(cfg))
    assert flops.attention_params(cfg) == weights
    assert flops.matmul_params(cfg) == 3 * (weights + 3 * 48 * cfg.resolved_ffn_dim) + 300 * 48


@pytest.mark.parametrize("spec,overrides,message", [
    ("arch=dint", ["model.gate=headwise"], r"model.gate: arch 'dint' has no gate \(archs with one: \('gated',\)\)"),
    ("arch=dint,gate=elementwise", [], "model.gate: arch 'dint' has no gate"),
    ("arch=transformer", ["model.gate=elementwise"], "model.gate: arch 'transformer' has no gate"),
    ("arch=gated", ["model.gate=rowwise"], r"model.gate: unknown gate 'rowwise' for arch 'gated'; choose one of "
                                           r"\('headwise', 'elementwise'\)"),
    ("arch=sink", ["model.attention_impl=pallas"], "attention_impl: impl 'pallas' has no attention kernel with sinks, "
                                                   "which arch 'sink' needs"),
    ("arch=sink", ["model.attention_impl=cudnn"], "attention_impl: impl 'cudnn' has no attention kernel with sinks, "
                                                  "which arch 'sink' needs"),
    ("arch=sink", ["model.attention_impl=tpu_flash"], "impl 'tpu_flash' has no attention kernel with sinks"),
    ("arch=dint", ["model.attention_impl=tpu_flash"], "attention_impl: impl 'tpu_flash' has no diff_attention "
                                                      "kernel, which arch 'dint' needs"),
    ("arch=gated", ["model.headwise_norm=true"], "model.headwise_norm: gated has no headwise norm"),
    ("arch=sink", ["model.headwise_norm=true"], "model.headwise_norm: sink has no headwise norm"),
    ("arch=sink", ["model.lambda_init=0.5"], "model.lambda_init: arch 'sink' has no λ_init"),
    ("arch=gated", ["model.n_kv_heads=3"], "model.n_kv_heads"),
])
def test_config_errors_name_the_field(spec, overrides, message):
    with pytest.raises(ConfigError, match=message):
        checks.load(f"configs/small.py:size=tiny,{spec}", overrides)


@pytest.mark.parametrize("impl", ["xla", "causal_blocks", "auto"])
def test_sink_takes_impls_with_sinks_and_auto_never_picks_one_without(impl):
    """sink calls the standard op with sinks: impls with the feature run it; auto skips those without it on every
    platform (tpu_flash, cudnn) and falls back to xla."""
    cfg = checks.load("configs/small.py:size=tiny,arch=sink", [f"model.attention_impl={impl}"])
    assert summary(cfg)["attention_kernel"] == {p: f"attention: {'xla' if impl == 'auto' else impl}"
                                                    for p in ("cpu", "gpu", "tpu")}
    assert kernels.choice("auto", "attention", "tpu") == "tpu_flash"  # without sinks it would
    with kernels.recording() as used:
        jax.jit(DecoderLM(_model("sink", attention_impl=impl)).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert used == {"attention": "xla" if impl == "auto" else impl}


@pytest.mark.parametrize("impl", ["xla", "causal_blocks", "cudnn", "auto"])
def test_dint_takes_impls_that_implement_both_of_its_ops(impl):
    """DINT calls the DIFF op and the standard op: an impl with both (or auto, per op) is accepted, and a forward
    pass resolves both ops (those that run on this CPU)."""
    checks.load("configs/small.py:size=tiny,arch=dint", [f"model.attention_impl={impl}"])
    if impl == "cudnn":
        return
    cfg = _model("dint", attention_impl=impl)
    tokens = jnp.zeros((1, 8), jnp.int32)
    with kernels.recording() as used:
        jax.jit(DecoderLM(cfg).init)(jax.random.key(0), tokens)
    assert used == dict.fromkeys(("diff_attention", "attention"), "xla" if impl == "auto" else impl)


def test_dint_cumulative_mean_equals_the_masked_row_mean_over_packed_documents(rng):
    """The O(T) cumulative mean (a sum restarting at each document) equals the T × T mask-weighted mean it replaces
    (and the decode path still uses) under the causal mask of packed documents, padding (id 0) included."""
    t = 23
    seg = np.stack([np.repeat([1, 2, 3, 0], [5, 9, 6, 3]), np.repeat([1, 2], [1, 22]), np.ones(t, int)])
    rows = jnp.asarray(rng.normal(size=(3, t, 2, 6)), jnp.float32)
    integral, cumulative_mean = jax.jit(dint_arch.integral), jax.jit(dint_arch.cumulative_mean)  # not op by op
    mask = reference.make_mask(3, t, t, causal=True, segment_ids=jnp.asarray(seg))
    expected = integral(mask, rows)
    np.testing.assert_allclose(cumulative_mean(rows, jnp.asarray(seg)), expected, rtol=1e-5, atol=1e-6)
    causal_only = reference.make_mask(3, t, t, causal=True)  # no segment ids: one document per row
    np.testing.assert_allclose(cumulative_mean(rows), integral(causal_only, rows), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["arch=gated", "arch=sink", "arch=dint"])
def test_a_few_training_steps_lower_the_loss(spec, tmp_path):
    overrides = ["data.seq_len=64", "data.batch_size=8", "data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6",
                 "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1", "train.checkpoint_every=1000",
                 "train.telemetry_every=0", "optim.warmup_steps=2", "optim.lr=3e-3", "train.steps=10"]
    result = train(checks.load(f"configs/small.py:size=tiny,{spec}", overrides), tmp_path, progress=False)
    curve = [loss for _, loss in sorted(losses(tmp_path).items())]
    assert result.step == 10 and np.all(np.isfinite(curve)) and np.isfinite(result.val["loss"]), curve
    assert np.mean(curve[-3:]) < np.mean(curve[:3]) - 0.3, curve


@pytest.mark.parametrize("config", ["configs/main.py:seeds=2,baselines=gated+sink+dint",
                                    "configs/ablation.py:seeds=1,data=corpus.txt,baselines=dint+gated"])
def test_studies_take_baselines_parameter_matched(config):
    """`baselines=` adds each baseline as a variant beside the study's own, matched in parameters to its DIFF row."""
    sweep = sweep_lib.load(config)
    by_variant = {m.variant: m.config.model for m in sweep.members}
    named = config.split("baselines=")[1].split("+")
    assert list(by_variant)[-len(named):] == named  # after the study's own variants
    diff = param_count(by_variant["diff"])["params"]
    for name in named:
        assert by_variant[name].arch == name
        assert abs(param_count(by_variant[name])["params"] / diff - 1) < 0.01, name
    with pytest.raises(ConfigError, match="baselines must be distinct registered archs"):
        sweep_lib.load(config.replace("dint", "dinty").replace("sink", "sinky"))
    # DIFF V2 joins with DIFF's heads, not parameter-matched: fewer parameters than DIFF
    v2 = {m.variant: m.config.model for m in sweep_lib.load(config.replace("baselines=", "baselines=diff_v2+")).members}
    shape = lambda m: (m.n_heads, m.head_dim)  # noqa: E731
    assert v2["diff_v2"].arch == "diff_v2" and shape(v2["diff_v2"]) == shape(by_variant["diff"])
    assert param_count(v2["diff_v2"])["params"] < diff

"""The architecture conformance suite: every arch registered in `diffjax/model/archs/` (and docs/design.md's sketch,
docs/sketches/my_arch.py, and the talking-heads arch of tests/fixtures/archs/, an arch on the plain XLA path, each
registered for the test alone) gets every generic check by being registered. What varies by arch is asked of its
`Arch` record (gates, head norm, λ, matching), never kept in a table here; checks of one arch's equations against an
oracle live with that arch (test_baseline_archs.py, test_diff_attention_oracle.py).

Each check: parameter matching with DIFF and the Transformer at every CPU size (and `diffjax summary` naming the
recipe's DIFF), the record's facts (head norm, λ, gates) against the parameters the layer creates and the λ it
computes, causality through gradients over packed documents (and every parameter reaching the logits), KV-cache
decoding against the full forward, scanned against unrolled layers, the attention map (shape, zero where unseen,
map @ V = the layer's heads, chosen rows = those rows), a sharded forward on 8 fake devices against one device, and
a tiny run: trained, restored from its checkpoint, every protocol that applies run on it. Matching aside, each runs
at the parameters as initialised and at those moved off them (`_moved`): an arch whose own parameters start neutral
(talking heads' mixes at identity, a sink at 0) is another arch at initialisation."""

import functools
import importlib.util

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures.archs import registered, talking_heads
from helpers import REPO

from diffjax import checks, recipes, sharding
from diffjax import eval as eval_lib
from diffjax.config import ConfigError, MeshConfig
from diffjax.eval.attention_maps import attention_maps
from diffjax.kernels import reference
from diffjax.model import DecoderLM, archs, decode_step, init_cache, layer_lambdas, param_count
from diffjax.summary import summary
from diffjax.train.loop import train
from diffjax.train.run_loader import load_run

SKETCH = "docs/sketches/my_arch.py"  # docs/design.md, "Extension points", shows this file
TOLERANCE = 0.005  # matched parameter counts within 0.5 % (docs/training.md)
VOCAB = recipes.BYTE_VOCAB
# Tokens [B, T] of the single-device checks: each arch and option builds its init and forward programs once
# (`_jitted`), and every check reuses them.
B, T = 2, 12


def load_sketch():
    """Import the docs' sketch (registering its arch in whatever `archs._REGISTRY` is now); its module."""
    spec = importlib.util.spec_from_file_location("my_arch_sketch", REPO / SKETCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SKETCH_ARCH = []  # the sketch's `Arch`, from its one import in this process: one layer class for the cached programs


def unregistered(param: str) -> archs.Arch:
    """The `Arch` of a test-only param: the sketch's (imported once, into a throwaway registry) or a fixture arch."""
    if param != SKETCH:
        return FIXTURE_ARCHS[param]
    if not _SKETCH_ARCH:
        with registered():
            _SKETCH_ARCH.append(load_sketch().ARCH)
    return _SKETCH_ARCH[0]


FIXTURE_ARCHS = {talking_heads.ARCH.name: talking_heads.ARCH}  # tests/fixtures/archs: never built in


@pytest.fixture(params=[*archs.names(), *FIXTURE_ARCHS, SKETCH])
def arch(request):
    """An arch's name: a built-in one, or a fixture arch's or the sketch's, registered for this test only."""
    if request.param in archs.names():
        yield request.param
        return
    extra = unregistered(request.param)
    with registered(extra):
        yield extra.name


def options(name: str) -> list[dict]:
    """The `model.*` options to check an arch under: its default, then each other gate it takes."""
    return [{}] + [{"gate": g} for g in archs.get(name).gates[1:]]


def tiny(name: str, **overrides):
    """The `tiny` CPU size of `name` (parameter-matched to DIFF's 2 heads of 16), float32."""
    return checks.check_model(recipes.model_config("tiny", name, dtype="float32", **overrides))


def _key(rng):
    return jax.random.key(int(rng.integers(1 << 30)))


@functools.cache
def _jitted(cfg):
    """(init, apply, decode_step) of `cfg`, jitted once for every check that builds or runs it."""
    return jax.jit(DecoderLM(cfg).init), jax.jit(DecoderLM(cfg).apply), jax.jit(functools.partial(decode_step, cfg))


def _init_boxed(cfg, rng):
    """Fresh parameters of `cfg` (with their logical-axis boxes), from the one init program of `cfg`."""
    return _jitted(cfg)[0](_key(rng), jnp.zeros((B, T), jnp.int32))["params"]


def _init(cfg, rng):
    """Fresh parameters of `cfg`, unboxed."""
    return nn.meta.unbox(_init_boxed(cfg, rng))


def _moved(params, rng):
    """`params` moved off their initial values, each by its own scale: x + σ·N(0, 1), σ its RMS (1 where it starts
    at zero), so that what starts neutral (mixes at identity, gates, λ's vectors, norms at 1, sinks at 0) and makes an
    arch equal another at initialisation takes part. Other arguments to the same programs, not new programs."""
    def move(x):
        x = np.asarray(x)
        scale = np.sqrt(np.mean(np.square(x))) or 1.0
        return jax.device_put((x + scale * rng.standard_normal(x.shape)).astype(x.dtype))  # a copy, not a program
    return jax.tree.map(move, params)


def _both(params, rng) -> dict:
    """What every check runs at: {"init": `params` as initialised, "moved": those `_moved`}."""
    return {"init": params, "moved": _moved(params, rng)}


def _forward(cfg, params, tokens):
    return _jitted(cfg)[1]({"params": params}, tokens)


def _packed(b: int, t: int, cut: int):
    """Segment ids and positions [b, t] of two packed documents, the second starting at `cut`."""
    second = np.arange(t) >= cut
    seg = np.broadcast_to(second + 1, (b, t))
    pos = np.broadcast_to(np.where(second, np.arange(t) - cut, np.arange(t)), (b, t))
    return jnp.asarray(seg), jnp.asarray(pos)


def test_parameters_match_diff_and_the_transformer_at_every_cpu_size(arch):
    """What `diffjax summary --config configs/small.py:size=...,arch=...` counts: within the documented tolerance of
    DIFF's and the Transformer's, and `summary` names the recipe's DIFF (h heads of d), not one worked out backwards."""
    if archs.get(arch).match is None:
        pytest.skip(f"{arch} keeps DIFF's heads (Arch.match=None): not parameter-matched")
    for size, (_, _, h, d, _) in recipes.SMALL_SIZES.items():
        diff, transformer = (param_count(recipes.model_config(size, a))["params"] for a in ("diff", "transformer"))
        for option in options(arch):
            cfg = checks.load(f"configs/small.py:size={size},arch={arch}" + "".join(f",{k}={v}" for k, v in
                                                                                   option.items()))
            n = param_count(cfg.model)["params"]
            assert abs(n / diff - 1) < TOLERANCE and abs(n / transformer - 1) < TOLERANCE, (size, option, n, diff)
            if cfg.model.arch != "diff":  # DIFF is the reference of the matching
                assert summary(cfg)["matched_to"].startswith(f"diff with {h} heads of {d} ({diff:,} parameters)")


def test_the_records_head_norm_lambda_and_gates_are_what_the_layer_has(arch, rng):
    """`Arch.headwise_norm` (the default of `model.headwise_norm`; None: none, and turning it on is refused),
    `layer_lambda` (λ per layer; None: `model.lambda_init` refused) and `gates` against the parameters the layer
    creates and the config checks."""
    spec, tokens = archs.get(arch), jnp.zeros((1, 8), jnp.int32)
    for setting in (None,) if spec.headwise_norm is None else (None, True, False):
        cfg = tiny(arch, headwise_norm=setting)
        params = jax.eval_shape(DecoderLM(cfg).init, jax.random.key(0), tokens)["params"]
        expected = bool(spec.headwise_norm if setting is None else setting)
        assert ("head_norm" in params["layer_0"]["attn"]) is archs.uses_headwise_norm(cfg) is expected, setting
    if spec.headwise_norm is None:
        with pytest.raises(ConfigError, match="has no headwise norm"):
            tiny(arch, headwise_norm=True)
    if spec.has_lambda_init:
        cfg = tiny(arch, lambda_init=0.5)
        lam = np.asarray(layer_lambdas(_init(cfg, rng), cfg))
        assert lam.shape == (cfg.n_layers,) and np.all(np.abs(lam - 0.5) < 0.5), lam  # near λ_init at init
        cfg, tokens = tiny(arch), jnp.asarray(rng.integers(0, VOCAB, (B, T)))  # the attention map check's program
        seg, pos = _packed(B, T, 7)
        for at, params in _both(_init(cfg, rng), rng).items():  # `layer_lambda` is the λ the layer computes
            sown = [layer["lambda"] for layer in _values(cfg, params, tokens, pos, seg)[1]]
            np.testing.assert_allclose(layer_lambdas(params, cfg), sown, rtol=1e-6, err_msg=at)
    else:
        with pytest.raises(ConfigError, match="has no λ_init"):
            tiny(arch, lambda_init=0.5)
    for gate in spec.gates:
        assert archs.gate(tiny(arch, gate=gate)) == gate
    with pytest.raises(ConfigError, match="model.gate"):
        tiny(arch, gate="no_such_gate")


def test_causality_through_gradients(arch, rng):
    """d logits[t] / d embedding(token at s) is zero exactly when s > t or s is in another document; and every
    parameter takes part (a parameter the layer makes but leaves out of its computation has no gradient)."""
    t_len, cut = 12, 5
    tokens = jnp.asarray(rng.permutation(VOCAB)[:t_len][None])  # distinct ids: one embedding row per position
    seg, pos = _packed(1, t_len, cut)
    for option in options(arch):
        cfg = tiny(arch, **option)
        model = DecoderLM(cfg)
        # the tokens an argument, not a constant: the program is the same for every draw (the persistent cache's)
        grad_fn = jax.jit(jax.grad(lambda p, t, tok: model.apply({"params": p}, tok, pos, seg)[0, t].sum()))  # noqa: B023
        for at, params in _both(_init(cfg, rng), rng).items():
            idle = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
            for t in (0, 3, 6, t_len - 1):
                grads = nn.meta.unbox(grad_fn(params, t, tokens))
                norms = np.linalg.norm(np.asarray(grads["embed"]["embedding"])[tokens[0]], axis=-1)
                seen = (np.arange(t_len) <= t) & ((np.arange(t_len) >= cut) == (t >= cut))
                assert np.all(norms[~seen] == 0) and np.all(norms[seen] > 0), (option, at, t, norms)
                idle -= {jax.tree_util.keystr(path) for path, g in jax.tree_util.tree_leaves_with_path(grads)
                         if np.asarray(g).any()}
            assert not idle, f"{option} {at}: the logits do not depend on {sorted(idle)}"


@pytest.mark.parametrize("scan", [False, True])
def test_kv_cache_decoding_matches_the_full_forward(arch, scan, rng):
    """A prompt chunk whose last two tokens are padding (the write index then moved back over them, as the icl
    protocol does), then one token at a time: every real token's logits equal the full forward's."""
    for option in options(arch):
        cfg = tiny(arch, scan_layers=scan, **option)
        tok = jax.random.randint(_key(rng), (B, T), 0, VOCAB)
        step = _jitted(cfg)[2]
        for at, params in _both(_init(cfg, rng), rng).items():
            full = _forward(cfg, params, tok)
            out, cache = step(params, init_cache(cfg, B, 16), jnp.concatenate([tok[:, :5], jnp.full((B, 2), 7)], 1))
            cache = jax.tree_util.tree_map_with_path(lambda path, x: x - 2 if path[-1].key == "index" else x, cache)
            outs = [out[:, :5]]
            for i in range(5, T):
                out, cache = step(params, cache, tok[:, i:i + 1])
                outs.append(out)
            np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-4, rtol=1e-4, err_msg=f"{option} {at}")


def _stack_layers(params, n_layers):
    """Unrolled `layer_i` parameters -> the scanned layout `layers/block` with a leading layer axis."""
    params = dict(nn.meta.unbox(params))
    layers = [params.pop(f"layer_{i}") for i in range(n_layers)]
    params["layers"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return params


def test_scanned_and_unrolled_layers_agree(arch, rng):
    """Logits, attention maps (over packed documents) and (where the arch has one) λ per layer, from the same
    parameters in either layout. The tiny size's 2 layers, each with its own parameters and λ_init (0.2, 0.36), tell
    the layers apart; the programs are the other checks' (the same configs and shapes)."""
    cfg, scan_cfg = tiny(arch), tiny(arch, scan_layers=True)
    tokens = jax.random.randint(_key(rng), (B, T), 0, VOCAB)
    seg, pos = _packed(B, T, 7)
    for at, params in _both(_init(cfg, rng), rng).items():
        stacked = _stack_layers(params, cfg.n_layers)
        np.testing.assert_allclose(_forward(scan_cfg, stacked, tokens), _forward(cfg, params, tokens), atol=1e-5,
                                   err_msg=at)
        np.testing.assert_allclose(attention_maps(scan_cfg, stacked, tokens, pos, seg),
                                   attention_maps(cfg, params, tokens, pos, seg), atol=1e-6, err_msg=at)
        if archs.get(arch).has_lambda_init:
            np.testing.assert_allclose(layer_lambdas(stacked, scan_cfg), layer_lambdas(params, cfg), rtol=1e-6,
                                       err_msg=at)


@functools.partial(jax.jit, static_argnums=0)
def _values(cfg, params, tokens, pos, seg):
    """(each layer's V [B·T, channels] as `attention.projections` made it (its `wv`), each layer's sown values)."""
    values = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, nn.Dense) and context.module.name == "wv":
            values.append(out)
        return out

    with nn.intercept_methods(record):
        _, inter = DecoderLM(cfg).apply({"params": params}, tokens, pos, seg, mutable=["intermediates"])
    return values, [{k: v[0] for k, v in inter["intermediates"][f"layer_{i}"]["attn"].items()}
                    for i in range(cfg.n_layers)]


@functools.partial(jax.jit, static_argnums=0)
def _rows_of_map(cfg, sown, mask, rows):
    """`Arch.attention_map` of the query rows `rows` (attention_noise's call), one program, not each op eagerly."""
    return archs.get(cfg.arch).attention_map(cfg, sown, mask, rows)


def test_the_attention_map_is_what_multiplies_v(arch, rng):
    """`attention_maps` (every protocol's maps) is [L, B, H, T, T] with H the arch's heads, zero where a query does
    not see the key (later, or another document); map @ V equals the heads the layer sowed before W_O (and any head
    norm or gate) — with T ≤ V's width that fixes every entry, so row sums (1 − λ for DIFF, less than 1 with a sink)
    follow; `attention_map(cfg, sown, mask, rows)` (attention_noise's few rows) is those rows of the whole map."""
    b, t, cut = B, T, 7
    tokens = jnp.asarray(rng.integers(0, VOCAB, (b, t)))
    seg, pos = _packed(b, t, cut)
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=seg)
    for option in options(arch):
        cfg = tiny(arch, **option)
        for at, params in _both(_init(cfg, rng), rng).items():
            maps = attention_maps(cfg, params, tokens, pos, seg)
            assert maps.shape == (cfg.n_layers, b, cfg.n_heads, t, t), (option, maps.shape)
            assert np.all(maps[..., ~np.asarray(mask[0, 0])] == 0), (option, at)
            values, sown = _values(cfg, params, tokens, pos, seg)
            assert len(values) == cfg.n_layers, f"{arch}: V not made by attention.projections (its `wv`) in each layer"
            for layer, (v, layer_sown) in enumerate(zip(values, sown, strict=True)):
                heads = np.asarray(layer_sown["heads"], np.float64)  # [B, T, H, e]
                v = np.asarray(v, np.float64).reshape(b, t, -1, heads.shape[-1])
                expected = np.einsum("bhts,bshe->bthe", maps[layer], np.repeat(v, cfg.n_heads // v.shape[2], axis=2))
                np.testing.assert_allclose(heads, expected, atol=2e-5, err_msg=f"{option} {at}, layer {layer}")
                arch_def = archs.get(cfg.arch)  # its declared combination of its softmax maps is its map
                probs = {name: reference.softmax(x, layer_sown.get("sinks"))
                         for name, x in arch_def.attention_logits(cfg, layer_sown, mask).items()}
                if (combined := arch_def.combined(layer_sown, probs)) is not None:
                    np.testing.assert_allclose(combined, maps[layer], atol=1e-6, err_msg=f"{option} {at}, {layer}")
                rows = jnp.asarray(rng.integers(0, t, (b, 3)))
                some = _rows_of_map(cfg, layer_sown, mask, rows)
                np.testing.assert_allclose(some, np.stack([maps[layer, i][:, rows[i]] for i in range(b)]), atol=1e-6,
                                           err_msg=f"{option} {at}, layer {layer}")


def test_a_sharded_forward_on_8_devices_equals_one_device(arch, rng):
    """data × fsdp × tensor = 2 × 2 × 2 fake CPU devices (the op under `shard_map`, parameters split by their
    logical axes) against the unsharded forward, over packed documents."""
    cfg = tiny(arch)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (8, 16)), jnp.int32)
    seg = jnp.asarray(np.cumsum(rng.random((8, 16)) < 0.15, axis=1) + 1, jnp.int32)
    boxed = _init_boxed(cfg, rng)

    def forward(params, tokens, seg):
        return DecoderLM(cfg).apply({"params": params}, tokens, None, seg)

    mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
    p_shard, batch = sharding.param_shardings(boxed, mesh), jax.NamedSharding(mesh, jax.P(sharding.BATCH))
    single, sharded = jax.jit(forward), sharding.MeshJit(forward, mesh, in_shardings=(p_shard, batch, batch))
    for at, params in _both(nn.meta.unbox(boxed), rng).items():
        want = single(params, tokens, seg)
        got = sharded(jax.device_put(params, p_shard), jax.device_put(tokens, batch), jax.device_put(seg, batch))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=at)


SEQ_LEN = 160
TINY_RUN = ["mesh.data=1", f"data.seq_len={SEQ_LEN}", "data.batch_size=2", "data.n_needles=1", "train.steps=2",
            "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2",
            "train.telemetry_every=0", "optim.warmup_steps=1"]
# The smallest value of each protocol option (by option name, for whichever protocols take it); others as default.
# needle's heat map at the trained length only: its one cell is Table 2's, predicted by retrieval's program (the
# default lengths, fractions of seq_len, would compile the forward at three more; test_eval_needle_noise checks them).
SMALLEST = {"n": 2, "batches": 1, "batch_size": 2, "depths": (0.0,), "tokens": 320, "bins": 2, "bits": (8,),
            "eval_batches": 1, "retrieval_n": 2, "needles": (1,), "query_cities": (1,), "n_docs": 1, "points": 2,
            "lengths": (SEQ_LEN,)}


@pytest.mark.slow  # trains, checkpoints and runs every protocol that applies (~10 s an arch)
def test_a_tiny_run_trains_restores_and_runs_every_protocol_that_applies(arch, tmp_path, rng):
    """Trained two steps, restored from its checkpoint; every protocol that applies runs at those parameters moved
    (`_moved`: two steps barely move what starts neutral), not twice."""
    cfg = checks.load(f"configs/small.py:size=tiny,arch={arch}", TINY_RUN)
    result = train(cfg, tmp_path, progress=False)
    assert result.step == 2 and np.isfinite(result.val["loss"])
    restored_cfg, state, _ = load_run(tmp_path)
    assert restored_cfg.model == cfg.model and int(state.step) == 2
    chex.assert_trees_all_equal(nn.meta.unbox(state.params), nn.meta.unbox(result.state.params))
    applicable = eval_lib.applicable(cfg)
    assert {"validation", "retrieval", "attention_noise"} <= {p.name for p in applicable}  # the map's protocol too
    params = _moved(state.params, rng)  # boxed as trained: the protocols' shardings read the boxes
    for protocol in applicable:
        options = {k: v for k, v in SMALLEST.items() if k in protocol.options()}
        out = protocol.run(cfg, params, **options)
        assert isinstance(out, dict) and out, protocol.name
        if protocol.markdown is not None:
            assert protocol.markdown({arch: out}), protocol.name

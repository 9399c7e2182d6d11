"""Context parallelism: the sequence split over the `context` mesh axis (8 fake CPU devices).

Each strategy (all_gather, ring) against the unsplit XLA reference — the op alone and the whole model, forward and
gradients, causal, with packed documents whose boundaries fall inside and across shards, GQA, DIFF, DIFF V2 and the
baseline —, training runs (mesh.context=4 × data=2 logs the losses of one device; 4096 tokens over 8 devices), and
the config checks.

Tolerances (float32, matmul precision "highest" from conftest): the split computes the same sums in another order —
all_gather sums a row over the keys in the layout's order, ring merges N partial softmaxes (online rescaling by
exp(m_old − m_new)) —, so outputs differ from the reference by float32 rounding, measured ≤ 4e-7 absolute on unit-
scale inputs (rtol 1e-5, atol 2e-6 leave ~5× room). Gradients sum many such terms (over tokens, heads, layers), so
an element's rounding error scales with its leaf's magnitude, not its own: measured ≤ 1e-6 of the leaf's largest
|value| (an embedding row of 2e-3 in a leaf reaching 7 was off by 1.3e-6), hence rtol 1e-4 with atol 1e-5 × the
leaf's max (`_assert_grads_close`; λ's leaves, sums that can cancel to near 0, × the sum's size without
cancellation). A masking or layout error moves values by O(0.1–1) of the leaf's scale.
"""

import dataclasses
import functools
import json
import re
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MICRO, TINY, assert_redone_exactly, cli_env, diffjax, losses, sets

from diffjax import checks, cli, kernels, sharding
from diffjax import config as config_lib
from diffjax.config import ConfigError, MeshConfig, ModelConfig
from diffjax.data.synthetic import retrieval_examples
from diffjax.eval import long_context, needle
from diffjax.model import DecoderLM, archs
from diffjax.model import context_parallel as cp
from diffjax.model.attention import attention_op
from diffjax.train import faults
from diffjax.train.loop import train
from diffjax.train.loss import training_token_losses
from diffjax.train.members import over_members
from diffjax.train.metrics import read_metrics
from diffjax.train.run_loader import load_run

B, T = 2, 32  # 4 context devices: 8 chunks of 4 tokens
# Packed documents (lengths per row; segment 0 = padding): boundaries inside chunks, documents spanning shards.
DOCS = ([5, 11, 9, 7], [20, 9])
STRATEGIES = ("all_gather", "ring")


def _packed(rng, vocab=128):
    """A packed batch as the data pipeline makes it: per-document positions, segment ids, padding (segment 0)."""
    segment_ids, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for row, lengths in enumerate(DOCS):
        start = 0
        for i, n in enumerate(lengths):
            segment_ids[row, start:start + n], positions[row, start:start + n] = i + 1, np.arange(n)
            start += n
    return {"tokens": jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32),
            "loss_mask": jnp.asarray((segment_ids > 0) & (rng.random((B, T)) < 0.8), jnp.float32),
            "segment_ids": jnp.asarray(segment_ids), "positions": jnp.asarray(positions)}


def _assert_grads_close(got, want, lambda_scale=None):
    """Each leaf within rtol 1e-4 and 1e-5 of its scale (module docstring). A λ gradient is one sum over every
    position and head that can cancel to near 0 while its rounding stays that of its terms: λ's leaves take
    `lambda_scale`, the sum's size without cancellation (the op tests: Σ|terms|), by default the largest λ gradient
    in the tree (each layer's sum cancels independently of the others)."""
    lambda_scale = _largest_lambda_grad(want) if lambda_scale is None else float(lambda_scale)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), map(np.asarray, jax.tree.leaves(want)),
                            strict=True):
        atol = max(1e-5 * (lambda_scale if _is_lambda(path) else np.max(np.abs(w))), 1e-7)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))


def _is_lambda(path) -> bool:  # the op's `lam`, the model's `lambda_q1` … `lambda_k2`
    return "lam" in jax.tree_util.keystr(path)


def _largest_lambda_grad(grads) -> float:
    return max((float(np.max(np.abs(w))) for path, w in jax.tree_util.tree_leaves_with_path(grads)
                if _is_lambda(path)), default=0.0)


def _lambda_scale(reference, arrays, weights):
    """Σ|w ∘ O2| for the DIFF op's loss Σ w ∘ (O1 − λ O2): the size of its λ gradient −Σ w ∘ O2 without
    cancellation (the op is linear in λ: O2 = out(λ = 0) − out(λ = 1)); None for the standard op. (Traced inside
    `_reference`'s program.)"""
    if len(arrays) != 6:
        return None
    o2 = reference(*arrays[:-1], jnp.float32(0)) - reference(*arrays[:-1], jnp.float32(1))
    return jnp.sum(jnp.abs(weights * o2))


@functools.partial(jax.jit, static_argnames="op")
def _reference(op, arrays, segment_ids, weights):
    """The unsplit XLA reference of `op` on `arrays` (causal, packed documents `segment_ids`): its output, the
    gradients of Σ weights ∘ output with respect to every array, and the size of λ's gradient without cancellation
    (`_lambda_scale`; None for the standard op). One jitted program per op and shape, shared by the split-op tests
    (every random input an argument, none a constant: the program does not depend on the seed)."""
    reference = functools.partial(getattr(kernels, op), causal=True, impl="xla", segment_ids=segment_ids)
    (_, out), grads = jax.value_and_grad(lambda *xs: (jnp.sum(reference(*xs) * weights), reference(*xs)),
                                         tuple(range(len(arrays))), has_aux=True)(*arrays)
    return out, grads, _lambda_scale(reference, arrays, weights)


def test_layout_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i():
    mesh = sharding.make_mesh(MeshConfig(data=2, context=4))
    with jax.set_mesh(mesh):
        index = np.asarray(jax.jit(lambda: cp.index(16))())
        x = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
        back = jax.jit(lambda x: cp.from_layout(cp.to_layout(x)))(x)
        assert cp.size(16) == 4 and cp.size(12) == 1  # 12 tokens cannot make 8 chunks: unsplit
    np.testing.assert_array_equal(index, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(back, x)
    assert cp.size(16) == 1  # no mesh


def _inputs(rng, op, heads, kv_heads, d=8):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    if op == "diff_attention":
        return (normal(B, T, heads, d), normal(B, T, heads, d), normal(B, T, kv_heads, d), normal(B, T, kv_heads, d),
                normal(B, T, kv_heads, 2 * d), jnp.float32(0.4))
    return normal(B, T, heads, d), normal(B, T, kv_heads, d), normal(B, T, kv_heads, d)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op,heads,kv_heads,mesh_sizes,packed", [
    ("diff_attention", 4, 2, dict(data=2, context=4), True), ("attention", 4, 2, dict(data=2, context=4), True),
    ("diff_attention", 4, 4, dict(data=1, context=4, tensor=2), True),
    ("diff_attention", 4, 2, dict(data=4, context=2), True), ("diff_attention", 4, 2, dict(data=2, context=4), False)],
    ids=["diff-gqa", "standard-gqa", "diff-tensor2", "diff-context2", "diff-unpacked"])  # context 2: no ring step
def test_split_op_equals_the_unsplit_reference(rng, strategy, op, heads, kv_heads, mesh_sizes, packed):
    """The op as the model calls it under a context mesh (inputs in the layout, through `attention_op`) equals the
    unsplit reference, forward and every gradient (q, k, v, λ); packed documents, or one per row (no segment ids)."""
    arrays = _inputs(rng, op, heads, kv_heads)
    segment_ids = _packed(rng)["segment_ids"] if packed else None
    weights = jnp.asarray(rng.normal(size=(B, T, heads, arrays[-2 if op == "diff_attention" else -1].shape[-1])),
                          jnp.float32)
    cfg = ModelConfig(context_strategy=strategy)

    def loss(segment_ids, weights, *xs):  # the random inputs are arguments: the program does not depend on the seed
        layout = [cp.to_layout(x) if x.ndim == 4 else x for x in xs]
        segments = None if segment_ids is None else cp.to_layout(segment_ids)
        out = cp.from_layout(attention_op(cfg, op, *layout, segment_ids=segments))
        return jnp.sum(out * weights), out

    want, want_grads, lambda_scale = _reference(op, arrays, segment_ids, weights)
    mesh = sharding.make_mesh(MeshConfig(**mesh_sizes))
    step = sharding.MeshJit(jax.value_and_grad(loss, tuple(range(2, 2 + len(arrays))), has_aux=True), mesh)
    (_, got), grads = step(segment_ids, weights, *arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    names = ("q1", "q2", "k1", "k2", "v", "lam") if op == "diff_attention" else ("q", "k", "v")
    _assert_grads_close(dict(zip(names, grads, strict=True)), dict(zip(names, want_grads, strict=True)),
                        lambda_scale)
    text = step.lower(segment_ids, weights, *arrays).as_text()
    assert ("all_gather" in text) == (strategy == "all_gather") and ("collective_permute" in text) == (
        strategy == "ring")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("kind", ["own", "earlier", "later", "full"])
@pytest.mark.parametrize("maps", [2, 1], ids=["diff", "standard"])
def test_fused_block_kernels_equal_the_reference_on_one_block(rng, platform, kind, maps):
    """The Pallas kernels (interpret mode) on each kind of block the split visits (`kernels/context_parallel.py`):
    the own block (causal on the diagonal), an earlier device's first chunk [2c queries, c keys], the second local
    chunk against a later device's block [c, 2c], and a non-causal block; packed documents with separate query and
    key segment ids, GQA; DIFF's two maps and the standard op's one. Forward: each map's output and log-sum-exp
    against the float32 reference; backward, given the block's own log-sum-exps and D_i = rowsum(dO ∘ O_i), against
    autodiff of the reference op on that block — what the block contributes when it is the only one. Tolerances as
    the op's (module docstring), one order looser for gradients: the kernels cast P to V's dtype per tile and
    accumulate in tiles."""
    from diffjax.kernels import pallas_gpu, pallas_tpu, reference

    blocks = (pallas_gpu if platform == "gpu" else pallas_tpu).block_kernels(interpret=True)
    # c = 16 (float32 GPU tiles 32 × 16: several key tiles on the diagonal, the earlier block's keys and the later
    # block's queries padded to a tile; TPU pads every block to 128), GQA with 2 query heads per key head
    c, h, kv, d = 16, 4, 2, 16
    tq, tk = {"own": (2 * c, 2 * c), "earlier": (2 * c, c), "later": (c, 2 * c), "full": (2 * c, 2 * c)}[kind]
    causal = kind == "own"
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    queries, keys, v = [normal(1, tq, h, d) for _ in range(maps)], [normal(1, tk, kv, d) for _ in range(maps)], \
        normal(1, tk, kv, 2 * d)
    # Documents that end inside the block; each query's document among the keys' (a query that sees no key has no
    # reference log-sum-exp: the split gives such a block zero weight, as the split op tests on packed documents run).
    # The diagonal block's queries are its keys.
    while True:
        q_seg = np.sort(rng.integers(0, 3, (1, tq)))
        k_seg = q_seg if causal else np.sort(rng.integers(0, 3, (1, tk)))
        if set(q_seg.flat) <= set(k_seg.flat):
            break
    q_seg, k_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(k_seg, jnp.int32)
    mask = jnp.asarray(q_seg[:, None, :, None] == k_seg[:, None, None, :])
    if causal:
        mask = mask & reference.make_mask(1, tq, tk, causal=True)
    segments = dict(q_segment_ids=q_seg, kv_segment_ids=k_seg)
    outs, lses = blocks.forward(queries, keys, v, causal=causal, **segments)
    assert len(outs) == len(lses) == maps
    for q, k, o, lse in zip(queries, keys, outs, lses, strict=True):
        logits = reference.attention_logits(q, k, mask)
        np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, -1), rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(o, reference.apply_probs(jax.nn.softmax(logits, -1), v), rtol=1e-5, atol=2e-6)
    lam, d_out = (jnp.float32(0.3) if maps == 2 else None), normal(1, tq, h, 2 * d)
    rowsums = [jnp.swapaxes(jnp.sum(d_out * o, -1), 1, 2) for o in outs]
    got = blocks.backward(queries, keys, v, lam, d_out, lses, rowsums, causal=causal, **segments)

    def op(qs, ks, v):
        if maps == 1:
            return reference.masked_attention(*qs, *ks, v, mask)
        return reference.masked_diff_attention(*qs, *ks, v, lam, mask)

    want = jax.grad(lambda qs, ks, v: jnp.sum(op(qs, ks, v) * d_out), argnums=(0, 1, 2))(queries, keys, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", ["diff_attention", "attention"])
def test_split_op_runs_the_fused_kernels_per_block(rng, strategy, op):
    """DIFF and the standard op split over context 4 × data 2 through the Pallas GPU kernels per block (interpret
    mode) equal the unsplit reference, forward and every gradient, causal with documents across shard boundaries and
    GQA — and the kernels really ran (`kernels.recording`). Tolerances as `test_split_op_equals_the_unsplit_reference`.
    """
    from diffjax.kernels import context_parallel as split_kernels

    arrays, segment_ids = _inputs(rng, op, 4, 2), _packed(rng)["segment_ids"]
    n = len(arrays) - (op == "diff_attention")  # the [B, T, heads, dim] arrays (not λ)
    weights = jnp.asarray(rng.normal(size=(B, T, 4, arrays[n - 1].shape[-1])), jnp.float32)
    split_op = functools.partial(getattr(split_kernels, op), axis_name="context", strategy=strategy,
                                 impl="pallas_gpu", interpret=True)
    mesh = sharding.make_mesh(MeshConfig(data=2, context=4))
    batch, context = jax.P("data", "context"), jax.P("context")

    def split(segment_ids, weights, *xs):  # the random inputs are arguments: the program does not depend on the seed
        layout = [cp.to_layout(x) for x in xs[:n]]
        out = jax.shard_map(lambda *a: split_op(*a[:-2], segment_ids=a[-2], index=a[-1]), mesh=mesh,
                            in_specs=(batch,) * n + (jax.P(),) * (len(xs) - n) + (batch, context), out_specs=batch,
                            check_vma=False)(*layout, *xs[n:], cp.to_layout(segment_ids), cp.index(T))
        return jnp.sum(cp.from_layout(out) * weights), cp.from_layout(out)

    argnums = tuple(range(2, 2 + len(arrays)))
    with kernels.recording() as record, jax.set_mesh(mesh):
        (_, got), grads = jax.jit(jax.value_and_grad(split, argnums, has_aux=True))(segment_ids, weights, *arrays)
    assert record == {op: f"pallas_gpu blocks ({strategy} over context)"}
    want, want_grads, lambda_scale = _reference(op, arrays, segment_ids, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    names = ("q1", "q2", "k1", "k2", "v", "lam") if op == "diff_attention" else ("q", "k", "v")
    _assert_grads_close(dict(zip(names, grads, strict=True)), dict(zip(names, want_grads, strict=True)),
                        lambda_scale)


def _summed_loss(cfg, params, batch):
    losses = training_token_losses(params, batch, config_lib.Config(model=cfg))
    return jnp.sum(losses * batch["loss_mask"])


@pytest.mark.parametrize("arch,strategy,mesh_sizes,extra", [
    ("diff", "all_gather", dict(data=2, context=4), {}),
    ("diff", "ring", dict(data=2, context=4), dict(scan_layers=True, remat="full")),
    ("transformer", "all_gather", dict(data=1, fsdp=2, context=2, tensor=2), dict(loss_chunk=4)),
    ("transformer", "ring", dict(data=2, context=4), dict(n_kv_heads=2)),
    ("diff_v2", "ring", dict(data=1, fsdp=2, context=4), dict(loss_chunk=8)),
    ("diff_v2", "all_gather", dict(data=2, context=4), {}),
    ("diff", "ring", dict(data=1, fsdp=2, context=2, tensor=2), dict(scan_layers=True, remat="attention")),
], ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_split_model_loss_and_gradients_equal_the_unsplit_model(rng, arch, strategy, mesh_sizes, extra):
    """The training loss of packed sequences (per-document positions: RoPE must see each token's own) and its
    gradients under a context mesh equal those of the model on one device."""
    heads = {"diff": 2, "transformer": 4, "diff_v2": 2}[arch]
    cfg = ModelConfig(arch=arch, vocab_size=128, d_model=64, n_layers=2, n_heads=heads, head_dim=8, dtype="float32",
                      context_strategy=strategy, **extra)
    checks.check_model(cfg)
    batch = _packed(rng)
    boxed = jax.jit(DecoderLM(cfg).init)(jax.random.key(int(rng.integers(1 << 30))), batch["tokens"])["params"]
    params = nn.meta.unbox(boxed)
    grad_fn = jax.value_and_grad(functools.partial(_summed_loss, cfg))

    def grads_and_logits(params, batch):  # the loss and its gradients, and the logits, in one program
        logits = DecoderLM(cfg).apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])
        return grad_fn(params, batch), logits

    (want_loss, want_grads), want = jax.jit(grads_and_logits)(params, batch)

    mesh = sharding.make_mesh(MeshConfig(**mesh_sizes))
    p_shard = sharding.param_shardings(boxed, mesh)
    step = sharding.MeshJit(grads_and_logits, mesh, in_shardings=(p_shard, sharding.batch_sharding(mesh)))
    (loss, grads), logits = step(jax.device_put(params, p_shard), batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_grads_close(grads, want_grads)

    # The logits (natural order out, whatever the layout inside) equal the unsplit model's too.
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("execution", ["vmap", "serial"])
def test_split_model_under_a_sweep_equals_each_member_unsplit(rng, execution):
    """Two stacked members over a sweep × data × context mesh (as a sweep chunk steps them, `over_members`)."""
    grad_fn, init, unsplit = _sweep_model()
    batch = _packed(rng)
    members = [nn.meta.unbox(init(jax.random.key(i), batch["tokens"])["params"]) for i in range(2)]
    want = [unsplit(p, batch) for p in members]
    mesh = sharding.make_mesh(MeshConfig(data=2, context=2), sweep=2)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *members)
    got = jax.tree.map(np.asarray, sharding.MeshJit(over_members(grad_fn, (0, None), execution), mesh)(stacked,
                                                                                                       batch))
    lambda_scale = _largest_lambda_grad([grads for _, grads in want])  # over both members: one layer each
    for i, (loss, grads) in enumerate(want):
        np.testing.assert_allclose(got[0][i], loss, rtol=1e-5)
        _assert_grads_close(jax.tree.map(lambda x, i=i: x[i], got[1]), grads, lambda_scale)


@functools.cache
def _sweep_model():
    """The sweep test's loss gradient (of its model config), its jitted init and unsplit gradient: built once, so
    that both executions' cases run the same init and reference programs."""
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, head_dim=8, dtype="float32",
                      context_strategy="ring")
    grad_fn = jax.value_and_grad(functools.partial(_summed_loss, cfg))
    return grad_fn, jax.jit(DecoderLM(cfg).init), jax.jit(grad_fn)


def test_config_checks_name_the_field(tmp_path, capsys):
    base = config_lib.load(TINY, MICRO)  # seq_len 64
    cases = [(["mesh.context=3"], "data.seq_len: 64 must be divisible by 2 × mesh.context = 6"),
             (["mesh.context=8", "data.seq_len=72"], "data.seq_len: 72 must be divisible by 2 × mesh.context = 16"),
             (["mesh.context=4", "model.loss_chunk=32"], "model.loss_chunk: 32 must divide each device's share"),
             (["mesh.context=0"], "mesh.context: must be a positive number"),
             (["model.context_strategy=tree"], "model.context_strategy: unknown strategy 'tree'"),
             (["mesh.context=4", "model.attention_impl=causal_blocks"], "model.attention_impl: 'causal_blocks' "
              "cannot run under context parallelism (mesh.context=4): it has no kernels for a block of a split "
              "sequence (diff_attention); use auto or xla or pallas or pallas_gpu or pallas_tpu")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            cfg = base
            for o in overrides:
                cfg = config_lib.override(cfg, o)
            checks.check(cfg)
    with pytest.raises(ConfigError, match=r"mesh: sweep×data×fsdp×context×tensor = \[1, 4, 1, 4, 1\] needs 16"):
        sharding.make_mesh(MeshConfig(data=4, context=4))
    with pytest.raises(ConfigError, match=r"mesh: 8 devices are not divisible by the fixed axes .* \[1, -1, 1, 3, 1\]"):
        sharding.make_mesh(MeshConfig(context=3))

    toy = archs.register(dataclasses.replace(archs.get("transformer"), name="toy_unsplit", context_parallel=False))
    try:
        with pytest.raises(ConfigError, match="mesh.context: arch 'toy_unsplit' does not support context"):
            checks.check(config_lib.override(config_lib.override(base, f"model.arch={toy.name}"), "mesh.context=4"))
    finally:
        archs._REGISTRY.pop(toy.name)
    # `diffjax summary` names the split strategy and what computes its blocks on each platform.
    assert cli.main(["summary", "--config", TINY, "--set", "mesh.context=4", "--set", "model.context_strategy=ring",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention_kernel"] == {
        "cpu": "diff_attention: xla (ring over context)", "gpu": "diff_attention: pallas blocks (ring over context)",
        "tpu": "diff_attention: pallas blocks (ring over context)"}
    # the baseline's blocks too: "auto" takes the Pallas kernels' one-map form, not its unsplit choice (cuDNN, TPU
    # flash attention: no per-block statistics)
    assert cli.main(["summary", "--config", TINY, "--set", "model.arch=transformer", "--set", "mesh.context=2",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention_kernel"] == {
        "cpu": "attention: xla (all_gather over context)", "gpu": "attention: pallas blocks (all_gather over context)",
        "tpu": "attention: pallas blocks (all_gather over context)"}
    # The CLI: one line naming the field, exit 2, before anything is written.
    assert cli.main(["train", "--config", TINY, *sets(MICRO + ["mesh.context=3"]), "--workdir", str(tmp_path),
                     "--no-progress"]) == 2
    assert "config error: data.seq_len: 64 must be divisible by 2 × mesh.context = 6" in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()


@pytest.mark.slow
def test_tiny_diff_run_with_context_4_logs_the_losses_of_one_device(tmp_path):
    """Training, validation and telemetry (whose maps are built from sown q, k in the layout) over mesh.context=4 ×
    data=2 record what one device records (relative 1e-4: float32, sums in another order)."""
    common = MICRO + ["train.steps=4", "train.eval_every=2", "train.telemetry_every=2", "model.n_heads=2",
                      "model.d_model=64"]
    train(config_lib.load(TINY, common + ["mesh.data=1"]), tmp_path / "one", progress=False)
    train(config_lib.load(TINY, common + ["mesh.data=2", "mesh.context=4"]), tmp_path / "split", progress=False)
    for split in ("train", "val"):
        one, split_losses = losses(tmp_path / "one", split), losses(tmp_path / "split", split)
        assert sorted(one) == sorted(split_losses) and one, split
        np.testing.assert_allclose([split_losses[s] for s in one], [one[s] for s in one], rtol=1e-4, err_msg=split)
    telemetry = [[r for r in read_metrics(tmp_path / run) if r["split"] == "telemetry"] for run in ("one", "split")]
    assert len(telemetry[0]) == len(telemetry[1]) == 2
    for a, b in zip(*telemetry, strict=True):
        for key in ("entropy_a1", "entropy_a2", "entropy_net", "max_logit_a1", "head_rms"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=key)


@pytest.mark.slow
def test_long_context_and_needle_evaluate_split_over_the_runs_context_axis(tmp_path):
    """Fig. 4's and Fig. 5's protocols run under the run's own mesh, as `diffjax eval` restores it (`load_run`):
    with mesh.context=4 the sequence is split over the context axis — the attention op records the ring as its
    kernel, which it does only inside its shard_map over `context` — and the per-position NLL and the greedy
    predictions equal those of the same checkpoint evaluated unsplit (`--set mesh.context=1`, one attention call per
    sequence on the XLA reference).

    Tolerances: the NLLs (5.8–6.8 nats) differ by the float32 rounding of sums in another order (measured ≤ 1e-6
    absolute, ~1.5e-7 relative), rtol 1e-5. Greedy predictions are compared where the unsplit logits' top-2 margin
    exceeds 1e-4: the logits agree to 2.2e-7 (measured), so no argmax there can flip; this barely trained model has
    small margins (the smallest 1.9e-4 here), so at least 90 % of the positions must be clear."""
    overrides = ["data.seq_len=128", "data.n_needles=1", "data.batch_size=4", "train.steps=2", "train.eval_every=1000",
                 "train.telemetry_every=0", "optim.warmup_steps=1", "model.context_strategy=ring"]
    run = tmp_path / "run"
    train(config_lib.load(TINY, overrides + ["mesh.data=2", "mesh.context=4"]), run, progress=False)
    (cfg, split, mesh), (_, one, one_mesh) = load_run(run), load_run(run, ["mesh.context=1"])
    assert (mesh.shape["context"], one_mesh.shape["context"]) == (4, 1)

    def kernel_of(fn, *args, **kwargs):
        """fn's result, and the kernel the DIFF attention op got while fn traced."""
        with kernels.recording() as record:
            out = fn(*args, **kwargs)
        return out, record.get("diff_attention")

    docs, _ = long_context.long_documents(cfg, 128, n_docs=2)
    nll, kernel = kernel_of(long_context.token_nll, cfg, split.params, docs, batch_size=2)
    want, unsplit_kernel = kernel_of(long_context.token_nll, cfg, one.params, docs, batch_size=2)
    assert (kernel, unsplit_kernel) == ("xla (ring over context)", "xla")
    assert nll.shape == (2, 128) and np.all(np.isfinite(nll))
    np.testing.assert_allclose(nll, want, rtol=1e-5)
    for chunk in (16, 24):  # the chunked loss within each device's 32 tokens; a chunk dividing no share: unchunked
        chunked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk=chunk))
        np.testing.assert_allclose(long_context.token_nll(chunked, split.params, docs, batch_size=2), want, rtol=1e-5)

    # needle through `diffjax eval` (the run's mesh) against the protocol on the unsplit checkpoint
    options = {"n": 4, "needles": (1,), "query_cities": (1,), "heatmap_needles": 1, "heatmap_query_cities": 1,
               "lengths": (128,), "batch_size": 4}
    code, kernel = kernel_of(cli.main, ["eval", "--workdir", str(run), "--protocol", "needle",
                                        *sets(f"eval.{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}"
                                              for k, v in options.items())])
    assert (code, kernel) == (0, "xla (ring over context)")
    got = json.loads((run / "eval" / "needle.json").read_text())
    want = needle.needle_eval(cfg, one.params, **options)
    assert got["heatmap"]["lengths"] == [128] and got["table2"] == want["table2"] and got["heatmap"] == want["heatmap"]
    batch = retrieval_examples(cfg.data, 4, depth=0.5, n_needles=1, n_query_cities=1, seq_len=128)
    predict = needle.make_predict(cfg, 4)
    logits = np.asarray(jax.jit(lambda p, b: DecoderLM(cfg.model).apply(
        {"params": p}, b["tokens"], b["positions"], b["segment_ids"]))(nn.meta.unbox(one.params), batch))
    top2 = np.sort(logits, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-4
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(predict(split.params, batch)[clear], logits.argmax(-1)[clear])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow
@pytest.mark.optimized  # its time is the three steps over 4096 tokens, not compiling them
def test_a_4096_token_sequence_trains_over_8_context_devices(tmp_path, strategy):
    cfg = config_lib.load(TINY, MICRO + ["data.seq_len=4096", "data.batch_size=1", "mesh.data=1", "mesh.context=8",
                                         f"model.context_strategy={strategy}", "train.steps=3", "model.loss_chunk=256"])
    result = train(cfg, tmp_path, progress=False)
    assert result.step == 3
    recorded = losses(tmp_path)
    assert sorted(recorded) == [2, 3] and all(np.isfinite(v) and 0 < v < 10 for v in recorded.values()), recorded


@pytest.mark.slow
def test_sigkill_then_resume_under_context_parallelism_continues_exactly(tmp_path):
    """A run over mesh.context=4 (ring) killed after step 9 (checkpoint at 5) trains steps 6-9 again to the losses it
    had, bitwise, and finishes: the checkpoint holds the state, the layout is rebuilt the same way."""
    steps, log = 10, open(tmp_path / "log.txt", "w")  # noqa: SIM115
    overrides = [f"train.steps={steps}", "train.checkpoint_every=5", *MICRO, "mesh.data=1", "mesh.context=4",
                 "model.context_strategy=ring"]
    run = lambda env: diffjax("train", "--config", TINY, "--workdir", tmp_path / "run",  # noqa: E731
                              "--no-progress", *sets(overrides), env=env, log=log)
    tail = (tmp_path / "log.txt").read_text
    victim = run(cli_env(4) | {faults.ENV: "SIGKILL@9"})  # stops itself (train/faults.py)
    assert victim.wait(timeout=300) == -signal.SIGKILL, tail()[-3000:]
    assert max(losses(tmp_path / "run")) == 9
    assert run(cli_env(4)).wait(timeout=300) == 0, tail()[-3000:]
    assert max(losses(tmp_path / "run")) == steps
    assert_redone_exactly(tmp_path / "run", at_least=3)  # 7-9: a start logs from its second step

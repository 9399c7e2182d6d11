"""Memory options change memory, not the numbers: the chunked cross-entropy (`model.loss_chunk`) and the remat
policies (`model.remat`) give the unchunked, un-rematerialised loss and gradients."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diffjax.config import Config, ConfigError, DataConfig, ModelConfig, from_dict, replace_field
from diffjax.model import DecoderLM
from diffjax.train.loss import resolved_chunk, training_token_losses

B, T, V = 3, 32, 300


@functools.partial(jax.jit, static_argnums=0)
def _init(model: ModelConfig, key, tokens):
    return nn.meta.unbox(DecoderLM(model).init(key, tokens)["params"])


@functools.partial(jax.jit, static_argnums=0)
def _grads(cfg: Config, params, batch):
    """d Σ training_token_losses / d params: one program per config, shared by the tests that take it."""
    return jax.grad(lambda p: training_token_losses(p, batch, cfg).sum())(params)


def _setup(rng, **model):
    cfg = Config(model=ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, head_dim=8, dtype="float32",
                                   **model), data=DataConfig(seq_len=T, batch_size=B))
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    batch = {"tokens": tokens, "targets": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T), (B, T)), "segment_ids": jnp.ones((B, T), jnp.int32)}
    params = _init(cfg.model, jax.random.key(int(rng.integers(1 << 30))), tokens)
    return cfg, params, batch


def _direct_losses(params, batch, cfg):
    """Independent of train/loss.py: the model's own full logits, then optax's cross-entropy."""
    logits = DecoderLM(cfg.model).apply({"params": params}, batch["tokens"], batch["positions"],
                                        batch["segment_ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _weighted_loss_and_grads(token_losses, cfg: Config, params, batch, weights):
    return jax.value_and_grad(lambda p: jnp.sum(token_losses(p, batch, cfg) * weights))(params)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [0, 8, 16])
def test_chunked_loss_equals_the_full_logits_loss(rng, tied, chunk):
    cfg, params, batch = _setup(rng, tie_embeddings=tied, loss_chunk=chunk)
    weights = jnp.asarray(rng.random((B, T)), jnp.float32)  # a per-token weighting catches a misplaced token
    want, want_grads = _weighted_loss_and_grads(_direct_losses, cfg, params, batch, weights)
    got, grads = _weighted_loss_and_grads(training_token_losses, cfg, params, batch, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the head's weight gradient is summed chunk by chunk, and the backward of every layer in another order:
    # float32 reordering: seen up to 3.4e-6 on a tied embedding's entry of 0.03 (its head and input gradients summed
    # in another order), 1 entry in 9,600; a misplaced token changes the loss itself, checked above at rtol 1e-6
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["attention", "full", "dots"])
@pytest.mark.parametrize("scan", [False, True])
def test_remat_policies_keep_the_gradients(rng, policy, scan):
    cfg, params, batch = _setup(rng, scan_layers=scan)
    remat_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))
    want, got = _grads(cfg, params, batch), _grads(remat_cfg, params, batch)
    # recomputation inside a scan lets XLA fuse (and so round) differently: float32 noise of ~1e-6 on O(1) values
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("arch", ["sink", "dint"])
def test_keeping_attention_for_the_backward_keeps_every_archs_gradients(rng, arch):
    """model.remat=attention wraps the kernel op in a VJP of its own: the gradients of every parameter — the sink
    logits (an op argument beside q, k, v) and DINT's two ops included — as without remat, on packed documents."""
    cfg, params, batch = _setup(rng, arch=arch)
    batch["segment_ids"] = jnp.asarray(1 + (np.arange(T) >= rng.integers(4, T - 4, (B, 1))), jnp.int32)
    remat_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="attention"))
    want, got = _grads(cfg, params, batch), _grads(remat_cfg, params, batch)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=3e-6)


def test_memory_options_are_validated():
    with pytest.raises(ConfigError, match="model.loss_chunk: 48 must divide data.seq_len"):
        replace_field(Config(), "model.loss_chunk", "48").validate()
    with pytest.raises(ConfigError, match="model.remat: unknown policy 'some'"):
        replace_field(Config(), "model.remat", "some").validate()
    # runs written before remat policies stored a bool
    assert from_dict({"model": {"remat": True}}).model.remat == "full"
    assert replace_field(Config(), "model.remat", "false").model.remat == "none"


def test_a_large_vocabulary_chunks_the_loss_by_default():
    """`loss_chunk = 0` chunks where a device's float32 logits would pass 256 MiB: with cl100k's 100,288 columns a
    step's compiled temporaries hold [B, c, vocab] logits, not [B, T, vocab] — smaller by at least the full logits'
    size less one chunk's — while byte-level vocabularies stay unchunked, and an explicit size is kept."""
    large = ModelConfig(vocab_size=100_288, d_model=32, n_layers=1, n_heads=2, head_dim=8, dtype="float32")
    # (rows, share) -> chunk: 16 × 256 at size tiny: 32 positions keep 16 × 32 × 100,288 × 4 B under 256 MiB
    cases = {(16, 256): 32, (2, 1024): 256, (1, 4096): 512, (1, 600): 0, (256, 64): 16}
    assert {k: resolved_chunk(large, *k) for k in cases} == cases
    assert resolved_chunk(dataclasses.replace(large, vocab_size=512), 16, 4096) == 0
    assert resolved_chunk(dataclasses.replace(large, loss_chunk=64), 16, 256) == 64

    b, t = 2, 1024
    batch = {"tokens": jnp.zeros((b, t), jnp.int32), "targets": jnp.zeros((b, t), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t), (b, t)), "segment_ids": jnp.ones((b, t), jnp.int32)}
    params = jax.eval_shape(lambda: nn.meta.unbox(DecoderLM(large).init(jax.random.key(0), batch["tokens"]))
                            ["params"])

    def temporaries(model):
        cfg = Config(model=model, data=DataConfig(seq_len=t, batch_size=b))
        grad = jax.jit(jax.grad(lambda p: training_token_losses(p, batch, cfg).mean()))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    logits = b * t * large.vocab_size * 4
    chosen, whole = temporaries(large), temporaries(dataclasses.replace(large, loss_chunk=t))
    assert whole - chosen >= logits * (1 - 256 / t), (whole, chosen, logits)

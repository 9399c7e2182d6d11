"""What every attention layer shares: λ_init, the q/k/v projections, the KV cache, and the call into the kernel op
(through `jax.shard_map` when a mesh is set). The layers live with their architecture in `diffjax/model/archs/`."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from diffjax import kernels, sharding
from diffjax.config import ModelConfig
from diffjax.kernels import context_parallel as split_kernels
from diffjax.kernels import reference
from diffjax.model import context_parallel
from diffjax.model.layers import RMSNorm, dense, rotary


def lambda_init_schedule(layer):
    """λ_init(l) = 0.8 − 0.6·exp(−0.3·(l − 1)) for the 1-based layer index l (works on arrays)."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * (jnp.asarray(layer, jnp.float32) - 1.0))


def lambda_inits(cfg: ModelConfig):
    """λ_init of every layer, [n_layers] float32 (the schedule, or the configured constant)."""
    if cfg.lambda_init is not None:
        return jnp.full((cfg.n_layers,), cfg.lambda_init, jnp.float32)
    return lambda_init_schedule(jnp.arange(1, cfg.n_layers + 1))


def projections(cfg: ModelConfig, x, *, q_heads: int, k_heads: int, v_heads: int, v_dim: int | None = None):
    """q [B, T, q_heads, d], k [B, T, k_heads, d], v [B, T, v_heads, v_dim (default d)]: W_Q, W_K, W_V of the calling
    layer (created in its scope as `wq`, `wk`, `wv`; with biases under `model.qkv_bias`), q and k each head
    RMS-normed (`q_norm`, `k_norm`, one scale of d per layer) under `model.qk_norm`, before any RoPE (Qwen3's order)."""
    dtype, d, v_dim = jnp.dtype(cfg.dtype), cfg.head_dim, v_dim or cfg.head_dim
    b, t, _ = x.shape
    x = x.reshape(b * t, -1)  # tokens as one axis: better matmul layouts on CPU (layers.SwiGLU)
    proj = functools.partial(dense, std=cfg.init_std, dtype=dtype, bias=cfg.qkv_bias)
    q = proj(q_heads * d, ("embed", "heads"), "wq")(x).reshape(b, t, q_heads, d)
    k = proj(k_heads * d, ("embed", "kv"), "wk")(x).reshape(b, t, k_heads, d)
    v = proj(v_heads * v_dim, ("embed", "kv"), "wv")(x).reshape(b, t, v_heads, v_dim)
    if cfg.qk_norm:
        q, k = RMSNorm(cfg.norm_eps, name="q_norm")(q), RMSNorm(cfg.norm_eps, name="k_norm")(k)
    return q, k, v


class KVCache(nn.Module):
    """Rotated keys and values for decoding, in the 'cache' collection, sized by `model.init(..., decode=True)` on a
    [B, max_len] input. Each call writes its T new entries at the current index and returns the full buffers, the
    mask, the new tokens' positions [B, T] and their slots [B, T].

    `start` [B] (0 unless `init_cache` sets it) is the slot of a row's first real token, left padding before it:
    positions count from it, real queries never see a padding key, and padding queries see only padding (causally),
    so no row of the mask is empty."""

    cfg: ModelConfig  # its RoPE settings rotate the keys

    @nn.compact
    def __call__(self, k, v):
        b, t = k.shape[:2]
        sizing = not self.has_variable("cache", "k")
        cached_k = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        start = self.variable("cache", "start", lambda: jnp.zeros((b,), jnp.int32))
        slots = jnp.broadcast_to(index.value + jnp.arange(t), (b, t))
        positions = slots - start.value[:, None]
        k = rotary(k, positions, self.cfg)
        if sizing:  # the init pass only creates the buffers
            return k, v, reference.make_mask(b, t, t, causal=True), positions, slots
        cached_k.value = lax.dynamic_update_slice_in_dim(cached_k.value, k, index.value, axis=1)
        cached_v.value = lax.dynamic_update_slice_in_dim(cached_v.value, v, index.value, axis=1)
        s = cached_k.value.shape[1]
        mask = reference.make_mask(b, t, s, causal=True, q_offset=index.value)
        padding_key = jnp.arange(s)[None, :] < start.value[:, None]  # [B, S]
        mask = mask & (~padding_key[:, None, None, :] | (positions < 0)[:, None, :, None])
        index.value = index.value + t
        return cached_k.value, cached_v.value, mask, positions, slots


def check_decode(segment_ids):
    if segment_ids is not None:
        raise ValueError("decode=True does not take segment_ids: a KV cache holds one sequence per row")


def rope_and_cache(layer: nn.Module, cfg: ModelConfig, q, k, v, positions, segment_ids, decode: bool, *,
                   mask: bool = False):
    """(q, k, v, mask, positions) as an attention layer attends with them. Decoding: k, v join the layer's KV cache,
    q is rotated, the mask is the cache's and the positions are the new tokens' slots in the cache (where DINT keeps
    its per-position rows). Otherwise q and k are rotated and sown as "qk" (and v as "v"); the causal / document mask
    is built only when `mask` asks for it (a layer attending in XLA: the kernel op builds its own)."""
    if decode:
        check_decode(segment_ids)
        k, v, cache_mask, positions, slots = KVCache(cfg, name="cache")(k, v)
        return rotary(q, positions, cfg), k, v, cache_mask, slots
    q, k = rotary(q, positions, cfg), rotary(k, positions, cfg)
    layer.sow("intermediates", "qk", (q, k))
    layer.sow("intermediates", "v", v)
    b, t = q.shape[:2]
    full = reference.make_mask(b, t, t, causal=True, segment_ids=segment_ids) if mask else None
    return q, k, v, full, positions


def output_projection(layer: nn.Module, cfg: ModelConfig, x, heads_BTHe, *, norm: bool = False, norm_scale=1.0,
                      gate=None):
    """W_O of the heads [B, T, H, e] (sown as "heads"), after each head's RMSNorm × `norm_scale` with `norm` (sown
    as "normed_heads") and a `gate` multiplied in float32."""
    dtype = jnp.dtype(cfg.dtype)
    layer.sow("intermediates", "heads", heads_BTHe)
    if norm:
        heads_BTHe = RMSNorm(cfg.norm_eps, name="head_norm")(heads_BTHe) * norm_scale
        layer.sow("intermediates", "normed_heads", heads_BTHe)
    if gate is not None:
        heads_BTHe = heads_BTHe.astype(jnp.float32) * gate
    b, t = heads_BTHe.shape[:2]
    out = heads_BTHe.astype(dtype).reshape(b * t, -1)  # tokens as one axis (as `projections`)
    return dense(x.shape[-1], ("heads", "embed"), "wo", std=cfg.init_std, dtype=dtype)(out).reshape(x.shape)


KEPT = "attention"  # the name `model.remat=attention` saves: the op's output and its backward's residuals


def _kept(fn, *arrays):
    """fn(*arrays), its output and every residual its backward needs named KEPT, so a remat policy saving that name
    never reruns the kernel's forward (naming the output alone would: the backward needs the softmax statistics)."""

    @jax.custom_vjp
    def kept(*xs):
        return fn(*xs)

    def forward(*xs):
        out, backward = jax.vjp(fn, *xs)  # `backward` is a pytree whose leaves are the residuals
        return checkpoint_name(out, KEPT), jax.tree.map(lambda r: checkpoint_name(r, KEPT), backward)

    kept.defvjp(forward, lambda backward, cotangent: backward(cotangent))
    return kept(*arrays)


def attention_op(cfg: ModelConfig, op: str, *arrays, segment_ids=None, sinks=None):
    """The kernel op `op` on `arrays` (`_attention_op`), kept for the backward pass under `model.remat=attention`."""
    # the inputs beside the arrays, an absent one not passed (only the standard op takes sinks)
    keywords = {name: x for name, x in (("segment_ids", segment_ids), ("sinks", sinks)) if x is not None}
    if cfg.remat != "attention":
        return _attention_op(cfg, op, arrays, keywords)

    # every array an argument of the custom VJP (a closed-over one would get no gradient); segment ids are ints
    def op_of(*xs):
        return _attention_op(cfg, op, xs[:len(arrays)], dict(zip(keywords, xs[len(arrays):], strict=True)))

    return _kept(op_of, *arrays, *keywords.values())


def _attention_op(cfg: ModelConfig, op: str, arrays, keywords):
    """`diffjax.kernels.<op>(*arrays, **keywords)`, causal, the configured impl (`sinks` [H] split over heads as the
    arrays are); under a mesh inside a fully manual `jax.shard_map`, over `context` too with context parallelism
    (docs/design.md §3, "Attention under `shard_map`" and "Context parallelism")."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(sharding.AXES) <= set(mesh.axis_names):
        return getattr(kernels, op)(*arrays, causal=True, impl=cfg.attention_impl, **keywords)
    (b, t), size = arrays[0].shape[:2], mesh.shape
    heads = ("tensor" if size["tensor"] > 1 and all(a.shape[2] % size["tensor"] == 0 for a in arrays if a.ndim == 4)
             else None)
    # data·fsdp, and `tensor` too when it cannot split the heads (no device repeats another's work), if they divide B
    batch_axes = tuple(a for a in sharding.BATCH if size[a] > 1)
    candidates = ([(*batch_axes, "tensor")] if size["tensor"] > 1 and heads is None else []) + [batch_axes]
    batch = next((axes for axes in candidates if axes and b % math.prod(size[a] for a in axes) == 0), None)
    context = context_parallel.AXIS if context_parallel.size(t) > 1 else None
    # Fully manual (Mosaic refuses anything less), except an axis that would split nothing: a replicated input of a
    # manual axis gets wrong gradients here.
    used = set(batch or ()) | {a for a in (heads, context) if a}
    idle = {a for a in mesh.axis_names if size[a] > 1 and a not in used and a != "sweep"}
    # every input's spec by what it is: a [B, T, heads, dim] array (the output too), λ, a keyword
    spec = {"heads": jax.P(batch, context, heads, None), "scalar": jax.P(), "segment_ids": jax.P(batch, context),
            "sinks": jax.P(heads), "index": jax.P(context)}
    if context:
        kernel = functools.partial(getattr(split_kernels, op), axis_name=context, strategy=cfg.context_strategy,
                                   impl=cfg.attention_impl)
        keywords = keywords | {"index": context_parallel.index(t)}
    else:
        kernel = functools.partial(getattr(kernels, op), impl=cfg.attention_impl)  # looked up per call
    in_specs = (tuple(spec["heads" if a.ndim == 4 else "scalar"] for a in arrays), {k: spec[k] for k in keywords})
    manual = jax.shard_map(lambda xs, kw: kernel(*xs, causal=True, **kw), mesh=mesh, in_specs=in_specs,
                           out_specs=spec["heads"], axis_names=set(mesh.axis_names) - idle, check_vma=False)
    return manual(arrays, keywords)

"""DiffAttention against a float64 NumPy oracle written here from the paper's equations (docs/design.md §2).

The oracle shares no code with diffjax: projections, rotary embeddings, the two softmaxes, λ, the headwise
RMSNorm and the (1 − λ_init) scale are all re-derived in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from diffjax.config import ModelConfig
from diffjax.model.archs.diff import DiffAttention

B, T, H, D = 2, 10, 4, 8
D_MODEL = 2 * H * D


def rope(x, pos, theta=10_000.0):
    """Rotate-half RoPE on the last dim of x [B, T, N, d] at integer positions [B, T]."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, :, None, None] * freq
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def softmax(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def oracle(p, x, pos, seg, lambda_init, n_kv, headwise_norm, eps=1e-5):
    """Multi-head differential attention, float64: (A1 − λ A2) V per head, headwise norm, W_O."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    q = rope((x @ p["wq"]).reshape(B, T, 2 * H, D), pos)  # sub-heads (2i, 2i+1) = (Q1_i, Q2_i)
    k = rope((x @ p["wk"]).reshape(B, T, 2 * n_kv, D), pos)
    v = (x @ p["wv"]).reshape(B, T, n_kv, 2 * D)
    lam = (np.exp(p["lambda_q1"] @ p["lambda_k1"]) - np.exp(p["lambda_q2"] @ p["lambda_k2"]) + lambda_init)
    allowed = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]
    heads = []
    for i in range(H):
        g = i // (H // n_kv)  # both halves of query head i read kv group g
        maps = []
        for half in (0, 1):
            s = np.einsum("btd,bsd->bts", q[:, :, 2 * i + half], k[:, :, 2 * g + half]) / np.sqrt(D)
            maps.append(softmax(np.where(allowed, s, -np.inf)))
        o = np.einsum("bts,bse->bte", maps[0] - lam * maps[1], v[:, :, g])
        if headwise_norm:
            o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * p["scale"] * (1 - lambda_init)
        heads.append(o)
    return np.concatenate(heads, -1) @ p["wo"]


@pytest.mark.parametrize("n_kv", [4, 2], ids=["n_rep1", "n_rep2"])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("headwise_norm", [True, False])
def test_diff_attention_matches_float64_oracle(n_kv, segments, headwise_norm, rng):
    cfg = ModelConfig(arch="diff", vocab_size=64, d_model=D_MODEL, n_layers=2, n_heads=H, head_dim=D,
                      n_kv_heads=n_kv, headwise_norm=headwise_norm, dtype="float32")
    cfg.validate()
    x = rng.normal(size=(B, T, D_MODEL))
    if segments:  # two packed documents per row, positions restarting at each
        cut = rng.integers(2, T - 2)
        seg = np.where(np.arange(T) < cut, 1, 2)[None].repeat(B, 0)
        pos = np.where(np.arange(T) < cut, np.arange(T), np.arange(T) - cut)[None].repeat(B, 0)
    else:
        seg, pos = np.ones((B, T), int), np.arange(T)[None].repeat(B, 0)
    lambda_init = 0.8 - 0.6 * np.exp(-0.3)  # layer 2 of the schedule
    module = DiffAttention(cfg)
    args = (jnp.float32(lambda_init), jnp.asarray(pos), jnp.asarray(seg) if segments else None)
    # The parameters' shapes only (init traced, not compiled): every value is drawn afresh below.
    shapes = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), jnp.asarray(x, jnp.float32), *args)["params"])
    # Fresh random values everywhere, with weights large enough that the two maps differ visibly.
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.3, jnp.float32), shapes)
    out = jax.jit(module.apply)({"params": params}, jnp.asarray(x, jnp.float32), *args)

    flat = {"wq": params["wq"]["kernel"], "wk": params["wk"]["kernel"], "wv": params["wv"]["kernel"],
            "wo": params["wo"]["kernel"], **{n: params[n] for n in ("lambda_q1", "lambda_k1", "lambda_q2",
                                                                        "lambda_k2")}}
    if headwise_norm:
        flat["scale"] = params["head_norm"]["scale"]
    expected = oracle(flat, x.astype(np.float32).astype(np.float64), pos, seg, lambda_init, n_kv, headwise_norm)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max())

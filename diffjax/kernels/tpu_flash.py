"""impl="tpu_flash": the standard op on TPU through JAX's Pallas flash attention
(`jax.experimental.pallas.ops.tpu.flash_attention`), so the baseline and DIFF V2 run a flash kernel at paper scale.

Adapter: [B, T, H, d] ↔ [B, H, T, d]; V wider than d in d-wide chunks; GQA by repeating kv heads; sequences padded
to 128 with the padded keys masked through segment ids (the kernel has no key-length mask). Its matmul precision
follows `jax_default_matmul_precision`: leave that unset for bf16 (Mosaic refuses fp32 on bf16 operands). On CPU,
differentiate inside `pltpu.force_tpu_interpret_mode()`: `interpret=True` covers only the forward call.
"""

from __future__ import annotations

import contextlib
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as fa

from diffjax.kernels.common import check_shapes, pad_axis, round_up
from diffjax.kernels.impl import Impl

BLOCK = 128


def attention(q, k, v, *, causal=True, segment_ids=None, interpret=False):
    check_shapes([q], [k], v, segment_ids)
    (b, t, h, d), (s, n_kv), e = q.shape, k.shape[1:3], v.shape[-1]
    if e % d:
        raise ValueError(f"v's head dim ({e}) must equal or be a multiple of q's ({d})")
    if n_kv != h:
        k, v = (jnp.repeat(x, h // n_kv, axis=2) for x in (k, v))
    tp, sp = round_up(t, BLOCK), round_up(s, BLOCK)
    seg = None
    if segment_ids is not None or tp != t or sp != s:
        q_seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        kv_seg = q_seg if segment_ids is not None else jnp.ones((b, s), jnp.int32)
        # padding's −1 matches only padding (so no row is empty); padded rows are sliced away
        seg = fa.SegmentIds(q=pad_axis(q_seg, 1, tp, value=-1), kv=pad_axis(kv_seg, 1, sp, value=-1))
    qt, kt, vt = (jnp.swapaxes(pad_axis(x, 1, n), 1, 2) for x, n in ((q, tp), (k, sp), (v, sp)))
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():  # V wider than d: d-wide chunks
        out = jnp.concatenate([fa.flash_attention(qt, kt, vt[..., i:i + d], segment_ids=seg, causal=causal,
                                                  sm_scale=1.0 / math.sqrt(d)) for i in range(0, e, d)], axis=-1)
    return jnp.swapaxes(out, 1, 2)[:, :t].astype(q.dtype)


IMPL = Impl(attention, platforms=("tpu",), auto=lambda call: True)  # "auto"'s standard op on TPU

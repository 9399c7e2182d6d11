"""The custom_vjp shared by the fused Pallas kernels (GPU and TPU): forward with residuals, then the
preprocess D_i = rowsum(dO∘O_i), the backward kernels and dλ = −Σ dO∘O2 (docs/design.md §4)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def fused_diff_attention(forward, backward_kernels, rowsum):
    """Wrap a platform's kernels as one differentiable op `op(q1, q2, k1, k2, v, lam, seg, cfg)`.

    forward(q1, q2, k1, k2, v, lam, seg, cfg, residuals) -> (o, o1, o2, lse1, lse2);
    backward_kernels(q1, q2, k1, k2, v, lam, seg, do, lse1, lse2, d1, d2, cfg) -> (dq1, dq2, dk1, dk2, dv);
    rowsum(do_f32, o_i_f32) -> D_i in the layout the backward kernels read (XLA fuses it into one pass).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def op(q1, q2, k1, k2, v, lam, seg, cfg):
        return forward(q1, q2, k1, k2, v, lam, seg, cfg, residuals=False)[0]

    def op_fwd(q1, q2, k1, k2, v, lam, seg, cfg):
        o, o1, o2, lse1, lse2 = forward(q1, q2, k1, k2, v, lam, seg, cfg, residuals=True)
        return o, (q1, q2, k1, k2, v, lam, seg, o1, o2, lse1, lse2)

    def op_bwd(cfg, res, do):
        q1, q2, k1, k2, v, lam, seg, o1, o2, lse1, lse2 = res
        dof = do.astype(jnp.float32)
        d1, d2 = rowsum(dof, o1.astype(jnp.float32)), rowsum(dof, o2.astype(jnp.float32))
        grads = backward_kernels(q1, q2, k1, k2, v, lam, seg, do, lse1, lse2, d1, d2, cfg)
        return (*grads, (-jnp.sum(d2)).astype(lam.dtype), None)  # ∂/∂λ of Σ dO∘(O1 − λO2)

    op.defvjp(op_fwd, op_bwd)
    return op

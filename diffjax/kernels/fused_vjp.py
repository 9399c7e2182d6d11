"""The custom_vjp shared by the fused Pallas kernels (GPU and TPU): forward with residuals, D_i = rowsum(dO∘O_i),
the backward kernels and, for DIFF, dλ = −Σ dO∘O2 (docs/kernels.md, "Backward")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from diffjax.kernels.common import lambda_grad


def fused_attention(forward, backward_kernels, rowsum):
    """A platform's kernels as one differentiable op `op(queries, keys, v, lam, seg, cfg)` of one softmax map
    (queries [q], keys [k], lam None) or two (DIFF). forward(..., cfg, residuals) -> (o, [O_i], [lse_i]);
    backward_kernels(..., do, lses, rowsums, cfg) -> ([dq_i], [dk_i], dv); rowsum(do_f32, o_i_f32) -> D_i."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def op(queries, keys, v, lam, seg, cfg):
        return forward(queries, keys, v, lam, seg, cfg, residuals=False)[0]

    def op_fwd(queries, keys, v, lam, seg, cfg):
        o, outs, lses = forward(queries, keys, v, lam, seg, cfg, residuals=True)
        return o, (queries, keys, v, lam, seg, outs, lses)

    def op_bwd(cfg, res, do):
        queries, keys, v, lam, seg, outs, lses = res
        dof = do.astype(jnp.float32)
        rowsums = [rowsum(dof, o.astype(jnp.float32)) for o in outs]
        d_queries, d_keys, dv = backward_kernels(queries, keys, v, lam, seg, do, lses, rowsums, cfg)
        return d_queries, d_keys, dv, lambda_grad(rowsums[-1], lam), None

    op.defvjp(op_fwd, op_bwd)
    return op

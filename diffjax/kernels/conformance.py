"""One comparison of an attention implementation against an oracle, shared by the kernel tests (tests/test_kernels.py)
and the on-device check (experiments/device_check.py): forward and backward (one vjp) on seeded random inputs, as
norm-relative errors ‖x − ref‖/‖ref‖ against the float32 XLA reference (bf16 cases: the same bf16 inputs, upcast).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.kernels import reference

GRAD_NAMES = ("q1", "q2", "k1", "k2", "v", "lam")
# Norm-relative tolerances per input dtype (forward, gradients); measured maxima on CPU at T ≤ 256: fp32 6e-7 / 8e-7,
# bf16 4e-3 / 7e-3 (bf16 rounding of the output and of P before the P·V and dS·K products).
TOLERANCES = {"float32": (5e-6, 1e-5), "bfloat16": (1e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    t: int
    h: int
    k: int
    d: int
    dtype: str
    causal: bool
    segments: bool = False
    s: int | None = None  # key length; None: == t

    @property
    def kv_len(self) -> int:
        return self.s or self.t


def make_inputs(case: Case, seed: int):
    """Random q1, q2, k1, k2, v (case dtype), λ, segment ids and an output cotangent (float32)."""
    rng = np.random.default_rng(seed)
    s, dt = case.kv_len, jnp.dtype(case.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

    q1, q2 = normal(case.b, case.t, case.h, case.d), normal(case.b, case.t, case.h, case.d)
    k1, k2 = normal(case.b, s, case.k, case.d), normal(case.b, s, case.k, case.d)
    v = normal(case.b, s, case.k, 2 * case.d)
    lam = jnp.float32(rng.uniform(0.2, 0.9))
    seg = None
    if case.segments:  # packed random documents: ids increase at random boundaries
        seg = jnp.asarray(np.cumsum(rng.random((case.b, case.t)) < 0.04, axis=1), jnp.int32)
    ct = jnp.asarray(rng.standard_normal((case.b, case.t, case.h, 2 * case.d), dtype=np.float32))
    return (q1, q2, k1, k2, v, lam), seg, ct


def rel_error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def vjp(fn, args, ct):
    """fn's output and the gradients of all its arguments for the cotangent `ct`, as one compiled program (op by op,
    each of its many small operations would be compiled alone)."""
    def forward_and_back(args, ct):
        out, pull = jax.vjp(fn, *args)
        return out, pull(ct.astype(out.dtype))
    return jax.jit(forward_and_back)(tuple(args), ct)


def _f32(args):
    return [jnp.asarray(a, jnp.float32) for a in args]


def reference_diff(args, seg, ct, causal):
    """Float32 XLA reference: output and the six gradients. "highest": float32 matmuls stay float32 on GPUs and
    TPUs too (their default would round operands to TF32 / bf16)."""
    with jax.default_matmul_precision("highest"):
        return vjp(lambda *a: reference.diff_attention(*a, causal=causal, segment_ids=seg), _f32(args), ct)


def reference_attention(args, seg, ct, causal):
    with jax.default_matmul_precision("highest"):
        return vjp(lambda *a: reference.attention(*a, causal=causal, segment_ids=seg), _f32(args), ct)


def _verdict(errors: dict, finite: bool, shape_ok: bool, tolerances: tuple[float, float]) -> dict:
    fwd_tol, grad_tol = tolerances
    grads = {k: v for k, v in errors.items() if k != "out"}
    worst = max(grads, key=lambda k: grads[k] if np.isfinite(grads[k]) else np.inf)
    passed = (finite and shape_ok and errors["out"] < fwd_tol and all(v < grad_tol for v in grads.values()))
    return dict(errors=errors, max_grad_error=grads[worst], worst_grad=worst, tolerance=dict(forward=fwd_tol,
                gradients=grad_tol), finite=finite, shape_ok=shape_ok, passed=bool(passed))


def _compare(fn: Callable, args, names, seg, ct, causal, oracle: Callable):
    """fn's and the oracle's (output, gradients); whether fn's output has the oracle's shape and the inputs' dtype and
    all of fn's results are finite; the norm-relative errors of the output and of each gradient (`names`)."""
    out, grads = vjp(lambda *a: fn(*a, causal=causal, segment_ids=seg), args, ct)
    ref_out, ref_grads = oracle(args, seg, ct, causal)
    shape_ok = out.shape == ref_out.shape and out.dtype == args[0].dtype
    finite = all(bool(np.all(np.isfinite(np.asarray(g, np.float32)))) for g in (out, *grads))
    errors = {"out": rel_error(out, ref_out)}
    errors |= {name: rel_error(g, rg) for name, g, rg in zip(names, grads, ref_grads, strict=True)}
    return (out, grads), (ref_out, ref_grads), shape_ok, finite, errors


def check_diff(fn: Callable, case: Case, seed: int, tolerances=TOLERANCES, oracle: Callable = reference_diff) -> dict:
    """`fn(q1, q2, k1, k2, v, lam, *, causal, segment_ids)` against `oracle(args, seg, ct, causal)` on `case`:
    {"errors": {"out", "q1", ..., "lam"}, "max_grad_error", "worst_grad", "tolerance": {"forward", "gradients"},
    "finite", "shape_ok", "passed"}: passed with the right shapes, finite results, every error in tolerance (a NaN
    error fails)."""
    args, seg, ct = make_inputs(case, seed)
    (out, grads), (ref_out, ref_grads), shape_ok, finite, errors = _compare(fn, args, GRAD_NAMES, seg, ct,
                                                                            case.causal, oracle)
    shape_ok &= all(g.shape == np.shape(rg) for g, rg in zip(grads, ref_grads, strict=True))
    # dλ = −Σ dO∘O2 is one sum of N terms of random sign, so ‖ref‖ can be small by cancellation: measure its error
    # against the typical size of such a sum, √N·rms(dO)·rms(out), when that is larger.
    scale = max(abs(float(ref_grads[5])), float(jnp.linalg.norm(ct) * jnp.linalg.norm(ref_out) / np.sqrt(ct.size)))
    errors["lam"] = abs(float(grads[5]) - float(ref_grads[5])) / scale
    return _verdict(errors, finite, shape_ok, tolerances[case.dtype])


def check_attention(fn: Callable, case: Case, seed: int, tolerances=TOLERANCES,
                    oracle: Callable = reference_attention) -> dict:
    """The standard op `fn(q, k, v, *, causal, segment_ids)` (q = case's q1, k = k1, v of width 2d) against
    `oracle`; the result as `check_diff`'s, with gradients q, k, v."""
    (q, _, k, _, v, _), seg, ct = make_inputs(case, seed)
    _, _, shape_ok, finite, errors = _compare(fn, (q, k, v), "qkv", seg, ct, case.causal, oracle)
    return _verdict(errors, finite, shape_ok, tolerances[case.dtype])

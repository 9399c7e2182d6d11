"""One conformance suite for every attention implementation (docs/design.md §4, §8).

`KernelConformance` checks the forward output and all six gradients (q1, q2, k1, k2, v, λ) of
`diff_attention` — and the standard `attention` op where an impl has one — against an oracle, with fresh
random inputs per test (seeded by class and case), norm-relative errors ‖x − ref‖/‖ref‖ and explicit
tolerances per dtype. The oracle is the float32 XLA reference for every impl except the XLA reference
itself, which is checked against an independent float64 NumPy implementation of the forward pass and of
the hand-derived backward (docs/kernels.md) — so the derivation the kernels use is checked too.

bf16 cases feed the same bf16-rounded inputs, upcast to float32, to the oracle.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import kernels
from diffjax.kernels import Call, causal_blocks, conformance, cudnn, mosaic_gpu, pallas_gpu, pallas_tpu, reference
from diffjax.kernels.conformance import GRAD_NAMES, TOLERANCES, Case, make_inputs, rel_error, vjp

# Small on purpose: interpret mode is slow. T=200 is ragged against every block size used below.
CASES = [
    Case("f32_d64_causal_gqa", 1, 256, 4, 2, 64, "float32", True),
    Case("f32_d128_noncausal_b2", 2, 128, 2, 2, 128, "float32", False),
    Case("bf16_d64_causal", 1, 256, 4, 4, 64, "bfloat16", True),
    Case("bf16_d128_causal_gqa", 1, 128, 4, 2, 128, "bfloat16", True),
    Case("f32_segments_causal_mqa", 2, 128, 2, 1, 64, "float32", True, segments=True),
    Case("bf16_segments_noncausal", 1, 256, 2, 2, 64, "bfloat16", False, segments=True),
    Case("f32_ragged200_causal_gqa", 1, 200, 4, 2, 64, "float32", True),
    Case("bf16_ragged200_noncausal_d128", 1, 200, 2, 1, 128, "bfloat16", False),
    Case("bf16_ragged200_causal_segments", 1, 200, 4, 2, 64, "bfloat16", True, segments=True),
    Case("f32_cross_t128_s192_noncausal", 1, 128, 2, 2, 64, "float32", False, s=192),
]
ATTENTION_CASES = [c for c in CASES if c.name in ("f32_d64_causal_gqa", "bf16_segments_noncausal",
                                                  "f32_ragged200_causal_gqa")]


# The float32 XLA oracles (`conformance.reference_diff`, `reference_attention`), jitted once with the segment ids as an
# argument: every class checking a case of the same shapes and masking shares one compiled program (called through
# `conformance` each compiles its own, the segment ids baked in as a constant).
@functools.partial(jax.jit, static_argnames="causal")
def reference_diff(args, seg, ct, causal):
    return conformance.reference_diff(args, seg, ct, causal)


@functools.partial(jax.jit, static_argnames="causal")
def reference_attention(args, seg, ct, causal):
    return conformance.reference_attention(args, seg, ct, causal)


# The forward of the XLA reference, jitted (op by op it compiles each of its small operations alone).
reference_forward = jax.jit(reference.diff_attention, static_argnames=("causal", "interpret"))


class KernelConformance:
    """Subclasses set `impl` (a registry name) and may override `diff`/`attn`/`oracle`/tolerances."""

    impl: str = "xla"
    interpret: bool = False
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    has_attention: bool = False
    has_diff: bool = True
    tolerances = TOLERANCES  # norm-relative (forward, gradients) per dtype; measured maxima in conformance.py

    def diff(self, q1, q2, k1, k2, v, lam, *, causal, segment_ids):
        return kernels.diff_attention(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids,
                                      impl=self.impl, interpret=self.interpret)

    def attn(self, q, k, v, *, causal, segment_ids):
        return kernels.attention(q, k, v, causal=causal, segment_ids=segment_ids, impl=self.impl,
                                 interpret=self.interpret)

    def oracle(self, args, seg, ct, causal):
        """Float32 XLA reference: output and the six gradients."""
        return reference_diff(tuple(args), seg, ct, causal)

    def attn_oracle(self, args, seg, ct, causal):
        return reference_attention(tuple(args), seg, ct, causal)

    def _seed(self, case: Case, what: str) -> int:
        return zlib.crc32(f"{type(self).__name__}/{what}/{case.name}".encode())

    def _skip_dtype(self, case: Case):
        if case.dtype not in self.dtypes:
            pytest.skip(f"{self.impl} does not take {case.dtype}")

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
    def test_diff_attention_forward_and_grads(self, case: Case):
        if not self.has_diff:
            pytest.skip(f"{self.impl} has no diff_attention op")
        self._skip_dtype(case)
        result = conformance.check_diff(self.diff, case, self._seed(case, "diff"), self.tolerances, oracle=self.oracle)
        print(f"{type(self).__name__} {case.name}: " + " ".join(f"{k}={v:.2e}" for k, v in result["errors"].items()))
        assert result["passed"], result

    @pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
    def test_attention_forward_and_grads(self, case: Case):
        if not self.has_attention:
            pytest.skip(f"{self.impl} has no standard attention op")
        self._skip_dtype(case)
        result = conformance.check_attention(self.attn, case, self._seed(case, "attn"), self.tolerances,
                                             oracle=self.attn_oracle)
        assert result["passed"], result

    @pytest.mark.parametrize("segments", [False, True])
    def test_causality_via_gradients(self, segments: bool):
        """∂out[t]/∂(k1, k2, v)[s] is exactly zero for s > t (and across documents with segment ids)."""
        if not self.has_diff:
            pytest.skip(f"{self.impl} has no diff_attention op")
        case = Case("causality", 1, 128, 2, 1, 64, self.dtypes[0], True, segments=segments)
        args, seg, _ = make_inputs(case, self._seed(case, f"causal{segments}"))
        t0 = 77

        def out_at_t0(k1, k2, v):
            q1, q2, _, _, _, lam = args
            out = self.diff(q1, q2, k1, k2, v, lam, causal=True, segment_ids=seg)
            return jnp.sum(out[:, t0].astype(jnp.float32))

        for name, g in zip(("k1", "k2", "v"), jax.jit(jax.grad(out_at_t0, argnums=(0, 1, 2)))(*args[2:5]),
                           strict=True):
            g = np.abs(np.asarray(g, np.float32)).sum(axis=(0, 2, 3))  # per key position
            assert np.all(g[t0 + 1:] == 0), f"{name}: gradient leaks from future keys"
            visible = np.arange(case.t) <= t0
            if seg is not None:
                visible &= np.asarray(seg[0]) == int(seg[0, t0])
                assert np.all(g[~visible] == 0), f"{name}: gradient leaks across documents"
            assert np.all(g[visible] > 0), f"{name}: visible keys must get gradient"


# ------------------------------------------------------------------------------------------ the oracle


def _numpy_diff_attention(q1, q2, k1, k2, v, lam, do, causal, seg):
    """Float64 NumPy: output and the six gradients from the hand-derived backward (docs/kernels.md)."""
    q1, q2, k1, k2, v, do = (np.asarray(x, np.float64) for x in (q1, q2, k1, k2, v, do))
    lam = float(lam)
    b, t, h, d = q1.shape
    s, n_kv = k1.shape[1], k1.shape[2]
    g = h // n_kv
    rep = lambda x: np.repeat(x, g, axis=2)  # noqa: E731  kv head per query head
    mask = np.ones((b, 1, t, s), bool)
    if causal:
        mask &= (np.arange(t)[:, None] >= np.arange(s)[None, :])[None, None]
    if seg is not None:
        seg = np.asarray(seg)
        mask &= seg[:, None, :, None] == seg[:, None, None, :]

    def probs(q, k):
        logits = np.where(mask, np.einsum("bthd,bshd->bhts", q, rep(k)) / np.sqrt(d), -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    p1, p2, vr = probs(q1, k1), probs(q2, k2), rep(v)
    out = np.einsum("bhts,bshe->bthe", p1 - lam * p2, vr)
    o2 = np.einsum("bhts,bshe->bthe", p2, vr)
    dp = np.einsum("bthe,bshe->bhts", do, vr)
    d1 = np.sum(dp * p1, -1, keepdims=True)  # == rowsum(dO∘O1)
    d2 = np.sum(dp * p2, -1, keepdims=True)
    ds1, ds2 = p1 * (dp - d1), -lam * p2 * (dp - d2)
    group_sum = lambda x: x.reshape(b, s, n_kv, g, -1).sum(3)  # noqa: E731
    grads = (np.einsum("bhts,bshd->bthd", ds1, rep(k1)) / np.sqrt(d),
             np.einsum("bhts,bshd->bthd", ds2, rep(k2)) / np.sqrt(d),
             group_sum(np.einsum("bhts,bthd->bshd", ds1, q1)) / np.sqrt(d),
             group_sum(np.einsum("bhts,bthd->bshd", ds2, q2)) / np.sqrt(d),
             group_sum(np.einsum("bhts,bthe->bshe", p1 - lam * p2, do)),
             -np.sum(do * o2))
    return out, grads


class TestXlaReference(KernelConformance):
    """The XLA reference (autodiff backward) against float64 NumPy (hand-derived backward)."""

    impl = "xla"
    has_attention = True
    tolerances = {"float32": (5e-6, 1e-5), "bfloat16": (1e-2, 2e-2)}  # bf16: the output/gradient casts

    def oracle(self, args, seg, ct, causal):
        return _numpy_diff_attention(*args, ct, causal, seg)

    def attn_oracle(self, args, seg, ct, causal):
        q, k, v = args  # standard attention is the λ = 0 case of the differential op (q2, k2 unused)
        out, (dq, _, dk, _, dv, _) = _numpy_diff_attention(q, q, k, k, v, 0.0, ct, causal, seg)
        return out, (dq, dk, dv)


# ------------------------------------------------------------------------------------ implementations

class TestCausalBlocks(KernelConformance):
    """The reference math per causal query block (blocks of 48: T = 128, 200, 256 end in a partial block)."""

    impl = "causal_blocks"
    has_attention = True

    def diff(self, *args, **kwargs):
        return causal_blocks.diff_attention(*args, block_q=48, **kwargs)

    def attn(self, *args, **kwargs):
        return causal_blocks.attention(*args, block_q=48, **kwargs)


def test_sinks_in_the_standard_op_across_impls():
    """`attention(..., sinks=)`: the reference equals softmax over the keys plus a zero-value sink key (float64
    NumPy), and causal_blocks (several blocks, GQA, packed documents) equals the reference, forward and gradients
    w.r.t. q, k, v and the sinks; "auto" never picks an impl without sinks, an explicit one is refused."""
    rng = np.random.default_rng(0)
    b, t, h, n_kv, d = 2, 100, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, n_kv, n_kv))
    sinks = jnp.asarray(rng.normal(size=h), jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 2]], [37, 63], axis=1).repeat(b, 0))
    mask = np.asarray(reference.make_mask(b, t, t, causal=True, segment_ids=seg))[:, 0]
    s64 = np.einsum("bthd,bshd->bhts", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 2)) / 4.0
    e = np.where(mask[:, None], np.exp(s64), 0.0)
    p = e / (np.exp(np.asarray(sinks, np.float64))[None, :, None, None] + e.sum(-1, keepdims=True))
    expected = np.einsum("bhts,bshe->bthe", p, np.repeat(np.asarray(v, np.float64), 2, 2))
    ref = jax.jit(reference.attention)(q, k, v, segment_ids=seg, sinks=sinks)
    np.testing.assert_allclose(ref, expected, rtol=1e-4, atol=1e-5)
    ct = jnp.asarray(rng.normal(size=ref.shape), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a[:3], segment_ids=seg, sinks=a[3]) * ct),
                                argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    blocks = functools.partial(causal_blocks.attention, block_q=48)
    assert rel_error(jax.jit(blocks)(q, k, v, segment_ids=seg, sinks=sinks), ref) < 1e-5
    for got, want in zip(grads(blocks), grads(reference.attention), strict=True):
        assert rel_error(got, want) < 1e-5
    assert kernels.choice("auto", "attention", "tpu", "bfloat16", ("sinks",)) == "xla"
    with pytest.raises(ValueError, match="'cudnn' has no attention kernel with sinks"):
        kernels.attention(q, k, v, sinks=sinks, impl="cudnn", interpret=True)


# Mixed, unequal blocks so that T = 128..256 spans several blocks in every kernel and causal bounds matter.
GPU_TEST_BLOCKS = pallas_gpu.BlockSizes(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=64, block_q_dq=64,
                                        block_k_dq=32)
# TPU: key blocks must be multiples of 128 (lanes), query blocks of 8 (sublanes).
TPU_TEST_BLOCKS = pallas_tpu.BlockSizes(block_q=64, block_k=128, block_q_dkv=64, block_k_dkv=128, block_q_dq=64,
                                        block_k_dq=128)


class TestPallasGpuInterpret(KernelConformance):
    impl = "pallas_gpu"
    interpret = True

    has_attention = True  # the same kernels with one map

    def diff(self, *args, **kwargs):
        return pallas_gpu.diff_attention(*args, interpret=True, block_sizes=GPU_TEST_BLOCKS, **kwargs)

    def attn(self, *args, **kwargs):
        return pallas_gpu.attention(*args, interpret=True, block_sizes=GPU_TEST_BLOCKS, **kwargs)

    def test_registry_dispatch(self):
        """`impl="pallas", interpret=True` reaches the Triton kernel on CPU, with the default blocks."""
        case = CASES[0]
        args, seg, _ = make_inputs(case, 0)
        out = kernels.diff_attention(*args, causal=True, impl="pallas", interpret=True)
        ref = reference_forward(*args, causal=True)
        assert rel_error(out, ref) < self.tolerances["float32"][0]



@pytest.mark.skipif(not mosaic_gpu.available(), reason=f"the Mosaic GPU kernels need jax >= 0.11 ({jax.__version__})")
@pytest.mark.all_cases  # only the newest-JAX run (--cases first-and-last) has a jax that runs them
class TestMosaicGpuInterpret(KernelConformance):
    """The Mosaic GPU kernels in Mosaic GPU's interpret mode (shared memory, barriers, TMA and wgmma simulated), at
    their default tiles: 64-row blocks, so T = 128..256 spans two to four key blocks and two warpgroups' rows."""

    impl = "mosaic_gpu"
    interpret = True
    dtypes = ("bfloat16",)
    has_attention = True

    @pytest.mark.parametrize("case", [Case("f16_segments_causal_gqa", 1, 128, 4, 2, 64, "float16", True, segments=True),
                                      Case("bf16_d96_causal_mqa", 1, 128, 2, 1, 96, "bfloat16", True),
                                      Case("bf16_d32_noncausal_b2", 2, 128, 2, 2, 32, "bfloat16", False)],
                             ids=lambda c: c.name)
    def test_float16_and_head_dims_padded_to_64(self, case: Case):
        """fp16 (wgmma's other input type; bf16's tolerances) and head dims zero-padded to a multiple of 64."""
        tolerances = {"float16": TOLERANCES["bfloat16"], "bfloat16": TOLERANCES["bfloat16"]}
        result = conformance.check_diff(self.diff, case, self._seed(case, "f16"), tolerances)
        assert result["passed"], result

    @pytest.mark.parametrize("blocks,case", [
        (dict(forward="maps", dq="maps", dkv="rows"), Case("bf16_d32_by_map", 1, 128, 4, 2, 32, "bfloat16", True,
                                                           segments=True)),
        (dict(compute_wgs=1, dkv="split"), Case("bf16_d128_by_rows", 1, 128, 2, 1, 128, "bfloat16", True)),
        (dict(dkv="pair"), Case("bf16_d64_dq_apart", 1, 256, 4, 2, 64, "bfloat16", True, segments=True)),
        (dict(compute_wgs=1, forward="maps", dq="maps", dkv="fused"),
         Case("bf16_d128_dq_in_dkv", 1, 128, 4, 2, 128, "bfloat16", True, segments=True))],
        ids=["d32_by_map_dkv_rows", "d128_by_rows_dkv_split", "d64_dq_apart", "d128_dq_in_dkv"])
    def test_tile_variants(self, blocks: dict, case: Case):
        """The kernels' other splits, which the device check may time and choose: forward and dQ by map and dK/dV by
        rows (at d = 32, padded to d = 64's kernels with V padded to 128: the split's halves of V whole tiles), and dQ
        in its own kernel; at d = 128 one warpgroup by rows (V in two forward launches, dK and dV apart), and dQ in the
        dK/dV kernel (P handed over in 16 bits, dS through P's tile, dQ added in 64-column halves)."""
        fn = functools.partial(mosaic_gpu.diff_attention, interpret=True, block_sizes=mosaic_gpu.BlockSizes(**blocks))
        result = conformance.check_diff(fn, case, self._seed(case, "tiles"))
        assert result["passed"], result

    def test_standard_op_with_v_as_wide_as_q(self):
        """The Transformer's shapes (V of Q's width), which take the paired dK/dV kernel (the conformance cases' V is
        twice as wide and takes the split one)."""
        case = Case("bf16_standard_pair", 1, 128, 4, 2, 64, "bfloat16", True, segments=True)
        (q, _, k, _, v, _), seg, ct = make_inputs(case, self._seed(case, "pair"))
        args, ct = (q, k, v[..., :case.d]), ct[..., :case.d]
        out, grads = vjp(lambda *a: mosaic_gpu.attention(*a, causal=True, segment_ids=seg, interpret=True), args, ct)
        ref_out, ref_grads = self.attn_oracle(args, seg, ct, True)
        fwd_tol, grad_tol = self.tolerances["bfloat16"]
        assert rel_error(out, ref_out) < fwd_tol
        for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
            assert rel_error(g, rg) < grad_tol, name

    def test_xla_deterministic_mode_keeps_dq_in_its_own_kernel(self, monkeypatch):
        """At d = 64 dQ is formed in the dK/dV kernel and summed by reduce-adds in the order tiles finish; under
        `--xla_gpu_deterministic_ops=true` (which cuDNN's backward obeys too) it keeps its own kernel."""
        (q1, q2, k1, k2, v, lam), _, _ = make_inputs(Case("bf16", 1, 128, 2, 2, 64, "bfloat16", True), 0)
        loss = lambda q: mosaic_gpu.diff_attention(q, q2, k1, k2, v, lam, interpret=True).astype(jnp.float32).sum()

        def kernels():
            jax.clear_caches()  # the mode is read when the backward is traced
            program = str(jax.make_jaxpr(jax.grad(loss))(q1))
            return {name for name in ("mgpu_diff_fwd", "mgpu_diff_dq", "mgpu_diff_dkv") if name in program}
        assert kernels() == {"mgpu_diff_fwd", "mgpu_diff_dkv"}
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true")
        assert kernels() == {"mgpu_diff_fwd", "mgpu_diff_dq", "mgpu_diff_dkv"}

    def test_registry_dispatch(self):
        """`impl="mosaic_gpu", interpret=True` reaches the kernel on CPU; float32 is refused by name."""
        case = CASES[2]
        args, _, _ = make_inputs(case, 0)
        out = kernels.diff_attention(*args, causal=True, impl="mosaic_gpu", interpret=True)
        ref = reference_forward(*[jnp.asarray(a, jnp.float32) for a in args], causal=True)
        assert rel_error(out, ref) < self.tolerances["bfloat16"][0]
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            kernels.diff_attention(*make_inputs(CASES[0], 0)[0], impl="mosaic_gpu", interpret=True)


class TestPallasTpuInterpret(KernelConformance):
    impl = "pallas_tpu"
    interpret = True

    has_attention = True

    def diff(self, *args, **kwargs):
        return pallas_tpu.diff_attention(*args, interpret=True, block_sizes=TPU_TEST_BLOCKS, **kwargs)

    def attn(self, *args, **kwargs):
        return pallas_tpu.attention(*args, interpret=True, block_sizes=TPU_TEST_BLOCKS, **kwargs)

    def test_registry_dispatch(self):
        case = CASES[0]
        args, _, _ = make_inputs(case, 0)
        out = kernels.diff_attention(*args, causal=True, impl="pallas_tpu", interpret=True)
        assert rel_error(out, reference_forward(*args, causal=True)) < self.tolerances["float32"][0]

    def test_short_sequence_pads_to_tpu_tile(self):
        """T = S = 40 < 128: blocks stay 128 (TPU tiles) and the sequence is padded, not tiled smaller."""
        assert pallas_tpu.BlockSizes().clamp(40) == pallas_tpu.BlockSizes()
        case = Case("short", 1, 40, 2, 1, 64, "float32", True, segments=True)
        args, seg, ct = make_inputs(case, self._seed(case, "short"))
        out, grads = vjp(lambda *a: self.diff(*a, causal=True, segment_ids=seg), args, ct)
        ref_out, ref_grads = self.oracle(args, seg, ct, True)
        fwd_tol, grad_tol = self.tolerances["float32"]
        assert rel_error(out, ref_out) < fwd_tol
        for name, g, rg in zip(GRAD_NAMES[:5], grads[:5], ref_grads[:5], strict=True):
            assert rel_error(g, rg) < grad_tol, name


def test_tpu_block_sizes_follow_tpu_tiling():
    blocks = pallas_tpu.BlockSizes.get_default()
    sizes = [getattr(blocks, f.name) for f in dataclasses.fields(blocks)]
    assert all(x % 128 == 0 for x in sizes), sizes
    assert blocks.multiple == 128
    for field, bad in [("block_k", 64), ("block_k_dkv", 200), ("block_k_dq", 0), ("block_q", 12),
                       ("block_q_dkv", -8), ("block_q_dq", 4)]:
        with pytest.raises(ValueError, match=rf"\b{field}\b"):
            pallas_tpu.BlockSizes(**{field: bad})
    # Query blocks only need 8 sublanes; the padding multiple is the lcm of unequal blocks.
    odd = pallas_tpu.BlockSizes(block_q=24, block_k=384)
    assert odd.multiple == 384
    assert odd.clamp(200) == dataclasses.replace(odd, block_k=256)


@pytest.mark.parametrize("module", [pallas_gpu, pallas_tpu, mosaic_gpu], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_fused_kernel_takes_only_its_own_block_sizes(module):
    """One wrapper (`common.public_ops`) checks every fused kernel's block sizes the same way, before any kernel
    is traced: another platform's tiling is refused by name, in both ops."""
    args, _, _ = make_inputs(CASES[0], 0)
    q, _, k, _, v, _ = args
    for other in {pallas_gpu, pallas_tpu, mosaic_gpu} - {module}:
        with pytest.raises(TypeError, match=rf"must be {module.__name__.rsplit('.', 1)[-1]}\.BlockSizes"):
            module.diff_attention(*args, interpret=True, block_sizes=other.BlockSizes())
        with pytest.raises(TypeError, match=rf"got {other.__name__}\.BlockSizes"):
            module.attention(q, k, v, interpret=True, block_sizes=other.BlockSizes())


def test_gpu_block_sizes_follow_triton_tiling():
    for field, bad in [("block_q", 48), ("block_k_dq", 8)]:
        with pytest.raises(ValueError, match=rf"\b{field}\b"):
            pallas_gpu.BlockSizes(**{field: bad})
    assert pallas_gpu.BlockSizes.get_default(head_dim=128).clamp(40).multiple == 64


def test_pallas_tpu_does_not_import_pallas_gpu():
    """Shared code lives in kernels/common.py; the TPU kernel must not depend on the GPU module."""
    tree = ast.parse(inspect.getsource(pallas_tpu))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names]
    assert not [name for name in imported if "pallas_gpu" in name], imported
    assert not [name for name, value in vars(pallas_tpu).items()
                if value is pallas_gpu or getattr(value, "__module__", None) == pallas_gpu.__name__]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")
class TestCudnn(KernelConformance):
    impl = "cudnn"
    dtypes = ("bfloat16",)
    has_attention = True


class TestCudnnCompositionOnXla(KernelConformance):
    """The cuDNN module's four-call composition, run through jax.nn's XLA path so it is checked on CPU."""

    impl = "cudnn-composition-xla"
    has_attention = True

    def diff(self, *args, **kwargs):
        return cudnn.diff_attention(*args, implementation="xla", **kwargs)

    def attn(self, *args, **kwargs):
        return cudnn.attention(*args, implementation="xla", **kwargs)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU (Hopper, cuDNN >= 9.10)")
class TestCudnnWideV(KernelConformance):
    impl = "cudnn_wide_v"
    dtypes = ("bfloat16",)


class TestCudnnWideVOnXla(KernelConformance):
    """FlashDiffAttn_1's composition (two calls with V of width 2d, then O1 − λO2), each call computed by the reference
    math so the composition around cuDNN is checked on CPU (the calls themselves: `TestCudnnWideV`, on a GPU)."""

    impl = "cudnn-wide-v-xla"

    def diff(self, *args, **kwargs):
        return cudnn.diff_attention_wide_v(*args, implementation="xla", **kwargs)


class TestTpuFlashInterpret(KernelConformance):
    """JAX's Pallas TPU flash attention behind the `attention` op (baseline and DIFF V2 on TPU), in TPU interpret
    mode: padding of ragged lengths, GQA by repetition and segment ids go through the same conformance cases."""

    impl = "tpu_flash"
    interpret = True
    has_attention = True
    has_diff = False

    @pytest.fixture(autouse=True)
    def _tpu_interpret(self):
        """The kernel's backward is traced after the forward returns: interpret mode must cover both."""
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            yield



def test_auto_resolves_per_backend():
    backend = jax.default_backend()
    fn = kernels.resolve("auto", "diff_attention")
    if backend in ("gpu", "tpu"):
        assert fn is kernels.IMPLS["pallas"].diff_attention
    else:
        assert fn is reference.diff_attention
        with pytest.raises(kernels.Unsupported, match=r"'pallas' does not run on cpu \(it runs on gpu, tpu\)"):
            kernels.resolve("pallas", "diff_attention")


def test_auto_skips_an_impl_that_cannot_take_the_dtype():
    """On a GPU, "auto" gives the baseline's attention to cuDNN for bf16 but not for float32 (cuDNN flash
    attention takes only half precision); the XLA reference takes float32."""
    with kernels.targeting("gpu"):
        assert kernels.resolve("auto", "attention", dtype=jnp.bfloat16) is kernels.IMPLS["cudnn"].attention
        assert kernels.resolve("auto", "attention", dtype=jnp.float32) is reference.attention


@pytest.mark.skipif(not mosaic_gpu.available(), reason=f"the Mosaic GPU kernels need jax >= 0.11 ({jax.__version__})")
def test_a_device_checks_measurement_sets_the_mosaic_gpu_tiles_and_auto(monkeypatch):
    """The table the device check writes (mosaic_gpu.TUNED): its fastest tiles become the default for that head dim
    and masking, and "auto" takes the kernel over cuDNN's composition only where it was measured faster."""
    slower = mosaic_gpu.candidates(128)["rows"]
    entry = dict(head_dim=128, causal=True, tiles="rows", blocks=dataclasses.asdict(slower), vs_cudnn=0.9)
    monkeypatch.setattr(mosaic_gpu, "_tuned_table", lambda: (entry,))
    assert mosaic_gpu.BlockSizes.get_default(96) == slower  # d = 96 is padded to 128
    assert mosaic_gpu.BlockSizes.get_default(128, causal=False) == next(iter(mosaic_gpu.candidates(128).values()))
    assert mosaic_gpu.BlockSizes.get_default(64) == next(iter(mosaic_gpu.candidates(64).values()))
    assert kernels.candidates(Call("diff_attention", "gpu", "bfloat16")) == ["mosaic_gpu", "cudnn", "pallas", "xla"]
    entry["vs_cudnn"] = 1.2
    assert kernels.candidates(Call("diff_attention", "gpu", "bfloat16")) == ["cudnn", "pallas", "xla"]


def test_choice_per_platform_and_dtype():
    """What `diffjax summary` reports: the kernel "auto" picks for each op on each platform."""
    assert kernels.choice("auto", "diff_attention", "tpu") == "pallas"
    # on a GPU the cuDNN composition first in half precision (measured faster, docs/kernels.md), Triton in float32
    assert kernels.choice("auto", "diff_attention", "gpu", "bfloat16") == "cudnn"
    assert kernels.choice("auto", "diff_attention", "gpu", "float32") == "pallas"
    assert kernels.choice("auto", "attention", "tpu") == "tpu_flash"
    assert kernels.choice("auto", "attention", "gpu", "bfloat16") == "cudnn"
    assert kernels.choice("auto", "attention", "gpu", "float32") == "xla"  # cuDNN flash takes half precision only
    assert kernels.choice("auto", "diff_attention", "cpu") == kernels.choice("auto", "attention", "cpu") == "xla"
    assert kernels.choice("xla", "attention", "tpu") == "xla"  # a named impl is used as named
    # what experiments/device_check.py checks on a device: auto's choice, then its fallbacks
    assert kernels.candidates(Call("diff_attention", "gpu", "bfloat16")) == ["cudnn", "pallas", "xla"]
    assert kernels.candidates(Call("diff_attention", "gpu", "float32")) == ["pallas", "xla"]
    assert kernels.candidates(Call("attention", "tpu", "float32")) == ["tpu_flash", "xla"]
    assert kernels.candidates(Call("attention", "cpu")) == ["xla"]
    # a block of a split sequence: the first impl in auto's order with block kernels — the Pallas kernels for both ops
    # (the standard op's unsplit choices have none), the reference on CPU
    for op in ("attention", "diff_attention"):
        assert kernels.choice("auto", op, "tpu", split=True) == "pallas"
        assert kernels.choice("auto", op, "gpu", split=True) == "pallas"
        assert kernels.choice("auto", op, "cpu", split=True) == "xla"
    assert kernels.choice("cudnn", "attention", "gpu", split=True) == "cudnn"  # a named impl as named


def test_auto_falls_back_to_cudnn_where_jax_has_no_triton_backend(monkeypatch):
    """JAX 0.12 deprecates the Pallas Triton backend: once it is gone, "auto" gives DIFF on a GPU to the cuDNN
    composition (bf16) or the XLA reference (float32), and the TPU keeps its Mosaic kernel."""
    monkeypatch.setattr(pallas_gpu, "plgpu", None)
    assert not pallas_gpu.triton_available()
    assert kernels.candidates(Call("diff_attention", "gpu", "bfloat16")) == ["cudnn", "xla"]
    assert kernels.choice("auto", "diff_attention", "gpu", "float32") == "xla"
    assert kernels.choice("auto", "diff_attention", "tpu") == "pallas"
    assert kernels.choice("auto", "attention", "gpu", split=True) == "xla"  # cuDNN has no block kernels
    with kernels.targeting("gpu"), pytest.raises(kernels.Unsupported, match="'pallas_gpu' needs Pallas' Triton"):
        kernels.resolve("pallas_gpu", "diff_attention")


@pytest.mark.parametrize("impl", ["xla", "causal_blocks"])
def test_the_differential_subtraction_is_float32_under_bfloat16(impl, rng):
    """A1 − λA2 must be formed in float32 even for bf16 inputs: where the two maps nearly cancel (q2 ≈ q1, λ ≈ 1),
    P is ~1 % of A1, and forming it from bf16-rounded maps would err by bf16's unit roundoff u = 2⁻⁸ of A1, i.e.
    ~u / 0.01 of P (tens of percent). Formed in float32, the only roundings left are P's before the P·V product
    and the output's, each ≤ u/2 of its value: the output is within 2u (norm-relative) of the float32
    computation on the same bf16 inputs. Subtracting bf16 maps in `reference.masked_diff_attention` fails this.
    The flash-style kernels (pallas, cudnn) form O1 − λO2 from two P·V products, each map's P rounded to bf16
    first, as the paper's FlashDiffAttn does: on these inputs they err by ~0.1, within their bf16 conformance
    tolerance on typical inputs (docs/kernels.md)."""
    b, t, h, d = 1, 160 if impl == "causal_blocks" else 64, 2, 32  # causal_blocks: > 128 rows, two blocks
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q1, k1, v = normal(b, t, h, d), normal(b, t, h, d), normal(b, t, h, 2 * d)
    q2, k2 = q1 + 0.01 * normal(b, t, h, d), k1 + 0.01 * normal(b, t, h, d)
    lam = np.float32(0.99)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q1, q2, k1, k2, v)]
    exact = reference.diff_attention(*[x.astype(jnp.float32) for x in bf16], lam)  # float32 throughout
    got = kernels.diff_attention(*bf16, lam, impl=impl)
    assert got.dtype == jnp.bfloat16
    err = rel_error(got.astype(jnp.float32), exact)
    assert err <= 2 * 2.0 ** -8, err

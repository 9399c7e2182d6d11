"""One attention op, several implementations chosen by name: `IMPLS`, each declaring in its own module what it runs
and refusing a `Call` with its reason (`impl.py`; docs/design.md §4); "auto" takes the first it may that does not
refuse, else "xla" (the reference, the oracle). Kernels are chosen for the *target* platform, the one `targeting` sets
(`sharding.MeshJit` sets its mesh's) else this host's backend, so a CPU host compiling for a TPU or GPU traces the
kernels that hardware would run; `recording` collects what each op got."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax

from diffjax.kernels import causal_blocks, cudnn, mosaic_gpu, pallas_gpu, pallas_tpu, reference, tpu_flash
from diffjax.kernels.impl import FEATURES, Call, Impl, Unsupported  # noqa: F401  (the registry's API)


def _pallas(name: str):
    """The target's Pallas kernels: Mosaic on TPU, Triton elsewhere (with interpret=True, how they run on CPU)."""
    return lambda *args, **kw: getattr(pallas_tpu if platform() == "tpu" else pallas_gpu, name)(*args, **kw)


# Every impl, in the order "auto" tries those it may take (`Impl.auto`). On a GPU, cuDNN's DIFF composition was
# measured faster than the Triton kernel (docs/kernels.md, "How auto chooses"); the Mosaic GPU kernel comes first only
# where a device check measured it faster than cuDNN (mosaic_gpu_tuned.json).
IMPLS: dict[str, Impl] = {
    "xla": reference.IMPL,
    "causal_blocks": causal_blocks.IMPL,
    "mosaic_gpu": mosaic_gpu.IMPL,  # the fused kernels on Mosaic GPU (Hopper: wgmma, TMA, warp-specialized)
    "cudnn": cudnn.IMPL,
    "tpu_flash": tpu_flash.IMPL,
    # the target's fused kernels: "auto" leaves the unsplit standard op to the tuned kernels of cuDNN and JAX
    "pallas": Impl(_pallas("attention"), _pallas("diff_attention"), ("gpu", "tpu"), blocks=_pallas("block_kernels"),
                   condition=lambda call: pallas_gpu.IMPL.condition(call) if call.platform == "gpu" else None,
                   auto=lambda call: call.op == "diff_attention" or call.split),
    "pallas_gpu": pallas_gpu.IMPL,
    "pallas_tpu": pallas_tpu.IMPL,
    "cudnn_wide_v": cudnn.WIDE_V,  # FlashDiffAttn_1: two cuDNN calls with V of width 2d (Hopper, cuDNN >= 9.10)
}

_TARGET = contextvars.ContextVar("diffjax_kernel_target", default=None)
_RECORD = contextvars.ContextVar("diffjax_kernel_record", default=None)


def normalize_platform(name: str) -> str:
    """Device platform names ("cuda", "rocm" for compile-only GPU devices) -> "cpu" | "gpu" | "tpu"."""
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def platform() -> str:
    """The platform kernels are chosen for: the one `targeting` set, else the default backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def targeting(target: str):
    """Choose kernels for `target` ("cpu", "gpu"/"cuda", "tpu") while tracing inside this block."""
    return _setting(_TARGET, normalize_platform(target))


def recording():
    """Collect {op: impl name} for every op resolved while tracing inside this block (the kernel each op got)."""
    return _setting(_RECORD, {})


def record(op: str, impl: str) -> None:
    if _RECORD.get() is not None:
        _RECORD.get()[op] = impl


def register(name: str, **fields) -> None:
    """Add an impl (`Impl`'s fields): a quantized variant, a user's kernel (docs/design.md, extension points)."""
    IMPLS[name] = Impl(**fields)


def names() -> list[str]:
    return ["auto", *IMPLS]


def refusal(impl: str, call: Call) -> str | None:
    """Why the registered `impl` cannot run `call`, or None ("auto" runs every call: "xla" is its fallback)."""
    return None if impl == "auto" else IMPLS[impl].refuses(call)


def candidates(call: Call) -> list[str]:
    """What "auto" tries for `call`, in order: the impls it may take that do not refuse it, "xla" last."""
    return [*(n for n, e in IMPLS.items() if e.refuses(call) is None and e.auto(call)), "xla"]


def choice(impl: str, op: str, target: str, dtype=None, features=(), split: bool = False) -> str:
    """What computes `op` on `target` under `impl` (the rest: `Call`'s fields): itself, or "auto"'s first candidate."""
    return impl if impl != "auto" else candidates(Call(op, target, dtype, tuple(features), split))[0]


def split_label(impl: str, label: str) -> str:
    """How a split op's impl is recorded and reported: "<impl> blocks <label>", or "xla <label>" (the reference)."""
    return f"xla {label}" if impl == "xla" else f"{impl} blocks {label}"


def _chosen(impl: str, call: Call, interpret: bool) -> str:
    """The impl that runs `call` here: "auto"'s choice, or `impl` unless it refuses (`interpret=True`: a named
    impl's own code on this host, whatever its platform)."""
    if impl == "auto":
        return candidates(call)[0]
    if impl not in IMPLS:
        raise Unsupported(f"unknown attention impl {impl!r}; known: {names()}")
    call = call._replace(platform=None) if interpret else call
    if reason := refusal(impl, call):
        raise Unsupported(f"attention impl {impl!r} {reason}; use 'auto' or one of "
                          f"{[n for n in IMPLS if refusal(n, call) is None]}")
    return impl


def resolve(impl: str, op: str, *, interpret: bool = False, dtype=None, features=()) -> Callable:
    """The function computing `op` for `impl` with inputs of `dtype` and the call's `features`; records it."""
    name = _chosen(impl, Call(op, platform(), dtype, tuple(features)), interpret)
    record(op, name)
    return getattr(IMPLS[name], op)


def split_blocks(impl: str, op: str, *, interpret: bool = False, dtype=None, label: str = ""):
    """For `op` on a sequence split over devices (`context_parallel.py`): the block kernels of the impl computing it,
    or None for the reference per block ("xla"); records `split_label`."""
    name = _chosen(impl, Call(op, platform(), dtype, split=True), interpret)
    record(op, split_label(name, label))
    return IMPLS[name].blocks(interpret)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False):
    fn = resolve(impl, "diff_attention", interpret=interpret, dtype=q1.dtype)
    return fn(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids, interpret=interpret)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, impl="auto", interpret=False):
    extra = {} if sinks is None else {"sinks": sinks}  # impls without the feature never see the keyword
    fn = resolve(impl, "attention", interpret=interpret, dtype=q.dtype, features=tuple(extra))
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, **extra, interpret=interpret)

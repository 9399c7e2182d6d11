"""One attention op, several implementations chosen by name (docs/design.md §4).

    diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False)
      q1, q2: [B, T, H, d]  k1, k2: [B, S, K, d]  v: [B, S, K, 2d]  lam: float32 scalar -> [B, T, H, 2d]
    attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, impl="auto", interpret=False)
      q: [B, T, H, d]  k: [B, S, K, d]  v: [B, S, K, e]  sinks: [H] float32 or None -> [B, T, H, e]

Implementations register themselves with `register(name, attention=..., diff_attention=..., available=...)`, and
name the optional features they support (`features=("sinks",)`): a call that uses one is never given an impl
without it ("auto" skips such impls; an explicit one is an error). An impl with `blocks` also computes one block of a
sequence split over devices (context parallelism: `split_blocks`, `split_choice`).
"xla" (the pure-JAX reference in `reference.py`) is always available and is the oracle.

Kernels are chosen for the *target* platform: the devices the step is compiled for (`targeting(platform)`, which
`sharding.MeshJit` sets from its mesh), else this host's default backend. So a CPU host compiling for a TPU slice
or a GPU node (`diffjax compile`) traces exactly the kernels that hardware would run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

import jax

from diffjax.kernels import reference


@dataclasses.dataclass(frozen=True)
class Impl:
    attention: Callable | None
    diff_attention: Callable | None
    available: Callable[[], bool] = lambda: True  # noqa: E731  (is it usable on the default backend?)
    dtypes: tuple[str, ...] | None = None  # input dtypes it takes (None: any); "auto" skips it for others
    platforms: tuple[str, ...] | None = None  # backends it runs on, where known (for `choice`)
    features: tuple[str, ...] = ()  # optional features of the ops it supports (FEATURES)
    # interpret -> its kernels on one block of a split sequence (`fused_blocks.FusedBlocks`, for each op it
    # implements), for context parallelism; None: a split sequence runs the reference per block
    blocks: Callable | None = None
    auto_ops: tuple[str, ...] | None = None  # the ops "auto" may give it (None: every op it implements)


_TARGET = contextvars.ContextVar("diffjax_kernel_target", default=None)
_RECORD = contextvars.ContextVar("diffjax_kernel_record", default=None)


def normalize_platform(platform: str) -> str:
    """Device platform names ("cuda", "rocm" for compile-only GPU devices) -> "cpu" | "gpu" | "tpu"."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def platform() -> str:
    """The platform kernels are chosen for: the one `targeting` set, else the default backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def targeting(target: str):
    """Choose kernels for `target` ("cpu", "gpu"/"cuda", "tpu") while tracing inside this block."""
    token = _TARGET.set(normalize_platform(target))
    try:
        yield
    finally:
        _TARGET.reset(token)


@contextlib.contextmanager
def recording():
    """Collect {op: impl name} for every op resolved while tracing inside this block (what `diffjax compile`
    reports: the kernel each op really got)."""
    record: dict[str, str] = {}
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


_REGISTRY: dict[str, Impl] = {}
FEATURES = ("sinks",)  # sinks: a per-head sink logit in `attention`'s softmax denominator (reference.attention_probs)
# "auto" tries these in order and takes the first that is available and implements the op.
AUTO_ORDER: list[str] = []


def register(name: str, *, attention=None, diff_attention=None, available=lambda: True, auto_rank=None,
             auto_ops=None, dtypes=None, platforms=None, features=(), blocks=None):
    """`platforms` (e.g. ("gpu",)) limits availability to those backends; `available` adds other conditions;
    `features` names the FEATURES its ops take; `auto_ops` the ops "auto" may give it (None: all it implements);
    `blocks` its kernels on a block of a split sequence."""
    if not set(features) <= set(FEATURES):
        raise ValueError(f"impl {name!r}: unknown features {features}; known: {FEATURES}")
    if platforms is not None:
        condition = available
        available = lambda: platform() in platforms and condition()  # noqa: E731
    _REGISTRY[name] = Impl(attention, diff_attention, available, dtypes, platforms, tuple(features), blocks,
                           None if auto_ops is None else tuple(auto_ops))
    if auto_rank is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, name)


def names() -> list[str]:
    return ["auto", *_REGISTRY]


def implements(impl: str, op: str, features=()) -> bool:
    """Whether `impl` ("auto" always does, through its xla fallback) has a function for `op` with `features`."""
    return impl == "auto" or (impl in _REGISTRY and getattr(_REGISTRY[impl], op) is not None
                              and set(features) <= set(_REGISTRY[impl].features))


def resolve(impl: str, op: str, *, interpret: bool = False, dtype=None, features=()) -> Callable:
    """The function implementing `op` ("attention" or "diff_attention") for `impl`.

    `interpret=True` names an impl explicitly to run it in Pallas interpret mode, so its backend check is
    skipped (that is how Pallas kernels run on CPU); "auto" still picks by availability, and by `dtype` (the
    inputs' dtype) where an impl takes only some (cuDNN flash attention: bf16 / fp16), and by `features` (those
    the call uses: an impl without one is never chosen).
    """
    if impl == "auto":
        impl = _auto(op, dtype, features)
    if impl not in _REGISTRY:
        raise ValueError(f"unknown attention impl {impl!r}; known: {names()}")
    fn = getattr(_REGISTRY[impl], op)
    if fn is None:
        raise ValueError(f"attention impl {impl!r} does not implement {op}")
    if not implements(impl, op, features):
        raise ValueError(f"attention impl {impl!r} does not support {', '.join(features)} in {op}; use 'auto' or "
                         f"one of {[n for n in _REGISTRY if implements(n, op, features)]}")
    if not interpret and not _REGISTRY[impl].available():
        raise ValueError(f"attention impl {impl!r} is not available on platform {platform()!r}")
    record(op, impl)
    return fn


def has_blocks(impl: str, op: str) -> bool:
    """Whether `impl` has kernels for `op` on one block of a split sequence (the fused Pallas kernels do)."""
    return impl in _REGISTRY and _REGISTRY[impl].blocks is not None and implements(impl, op)


def split_blocks(impl: str, op: str, *, interpret: bool = False, dtype=None, label: str = ""):
    """For `op` on a sequence split over devices (`context_parallel.py`): the block kernels of the impl that
    `split_choice` gives, or None where that is "xla" and the split runs the reference per block. Records
    "<impl> blocks <label>" or "xla <label>" for `recording`."""
    name = _split_auto(op, dtype) if impl == "auto" else impl
    resolve(name, op, interpret=interpret, dtype=dtype)  # the same checks as an unsplit call
    record(op, split_label(name, op, label))
    return _REGISTRY[name].blocks(interpret) if has_blocks(name, op) else None


def split_choice(impl: str, op: str, platform: str, dtype: str = "bfloat16") -> str:
    """The impl that computes `op`'s blocks of a split sequence on `platform` (`choice` for the split): a named impl
    as named; "auto" takes the first in its order with block kernels for `op` (the standard op's unsplit kernels,
    cuDNN and JAX's TPU flash attention, expose no per-block statistics), else "xla"."""
    if impl != "auto":
        return impl
    with targeting(platform):
        return _split_auto(op, dtype)


def _split_auto(op: str, dtype) -> str:
    return next((n for n in _candidates(op, dtype, for_auto=False) if has_blocks(n, op)), "xla")


def split_label(impl: str, op: str, label: str) -> str:
    """What computes `op`'s blocks of a split sequence under the resolved `impl`: "<impl> blocks <label>" for its
    block kernels, else "xla <label>" (the reference per block)."""
    return f"{impl} blocks {label}" if has_blocks(impl, op) else f"xla {label}"


def record(op: str, impl: str) -> None:
    """Note that `op` got `impl` (for `recording`; the context-parallel op notes its strategy this way)."""
    if _RECORD.get() is not None:
        _RECORD.get()[op] = impl


def _candidates(op: str, dtype, features=(), for_auto: bool = True) -> list[str]:
    """The impls in AUTO_ORDER that implement `op` with `features`, take `dtype` (None: any), are available and (with
    `for_auto`) let "auto" give them `op`, then "xla"."""
    found = []
    for name in AUTO_ORDER:
        entry = _REGISTRY[name]
        takes = entry.dtypes is None or dtype is None or str(jax.numpy.dtype(dtype)) in entry.dtypes
        allowed = not for_auto or entry.auto_ops is None or op in entry.auto_ops
        if implements(name, op, features) and takes and allowed and entry.available():
            found.append(name)
    return [*found, "xla"]


def _auto(op: str, dtype, features=()) -> str:
    return _candidates(op, dtype, features)[0]


def choice(impl: str, op: str, platform: str, dtype: str = "bfloat16", features=()) -> str:
    """The impl name that `impl` (e.g. "auto") resolves to for `op` (using `features`) on `platform` ("cpu", "gpu",
    "tpu") and input `dtype`, without running there (what `diffjax summary` reports)."""
    if impl != "auto":
        return impl
    with targeting(platform):
        return _auto(op, dtype, features)


def candidates(op: str, platform: str, dtype: str = "bfloat16", features=()) -> list[str]:
    """What "auto" would try for `op` on `platform` and `dtype`, in its order: the first is `choice`'s answer, the
    rest its fallbacks, "xla" always last (what `experiments/device_check.py` checks on a device)."""
    with targeting(platform):
        return _candidates(op, dtype, features)


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False):
    fn = resolve(impl, "diff_attention", interpret=interpret, dtype=q1.dtype)
    return fn(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids, interpret=interpret)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, impl="auto", interpret=False):
    if sinks is None:  # impls without the feature never see the keyword
        fn = resolve(impl, "attention", interpret=interpret, dtype=q.dtype)
        return fn(q, k, v, causal=causal, segment_ids=segment_ids, interpret=interpret)
    fn = resolve(impl, "attention", interpret=interpret, dtype=q.dtype, features=("sinks",))
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, sinks=sinks, interpret=interpret)


register("xla", attention=reference.attention, diff_attention=reference.diff_attention, features=("sinks",))
# The reference math in causal query blocks that skip masked keys (causal_blocks.py): an explicit impl, faster on
# CPU for T > 128 (docs/benchmarks.md, "Train step against the peer"); not (yet) in auto's order.
from diffjax.kernels import causal_blocks as _causal_blocks  # noqa: E402

register("causal_blocks", attention=_causal_blocks.attention, diff_attention=_causal_blocks.diff_attention,
         features=("sinks",))


# Pallas (fused kernel) and cuDNN (the paper's composition). "pallas" is the platform's kernel: Mosaic TPU on
# TPU, Triton everywhere else (with interpret=True that is how it runs on CPU); "pallas_gpu"/"pallas_tpu"
# name one variant explicitly (tests run both in interpret mode). On a GPU "auto" gives DIFF in bf16/fp16 to cudnn's
# composition, measured 1.4-2.1x faster than the Triton kernel on an H200 (docs/benchmarks.md, "Device check"), and
# float32 to pallas; on a TPU cudnn is unavailable and pallas (Mosaic) is first (docs/kernels.md, "How auto chooses").
from diffjax.kernels import cudnn as _cudnn  # noqa: E402
from diffjax.kernels import pallas_gpu as _pallas_gpu  # noqa: E402
from diffjax.kernels import pallas_tpu as _pallas_tpu  # noqa: E402
from diffjax.kernels import tpu_flash as _tpu_flash  # noqa: E402


def _pallas(op: str):
    def call(*args, **kwargs):
        return getattr(_pallas_tpu if platform() == "tpu" else _pallas_gpu, op)(*args, **kwargs)
    return call


def _pallas_blocks(interpret):
    return (_pallas_tpu if platform() == "tpu" else _pallas_gpu).block_kernels(interpret)


# The standard op is in these kernels too (one map): for an explicit impl and for blocks of a split sequence; "auto"
# gives it JAX's own (tpu_flash, cudnn) unsplit, tuned where ours are not (no accelerator has timed them).
register("pallas", attention=_pallas("attention"), diff_attention=_pallas("diff_attention"), platforms=("gpu", "tpu"),
         auto_rank=0, auto_ops=("diff_attention",), blocks=_pallas_blocks,
         available=lambda: platform() == "tpu" or _pallas_gpu.triton_available())
register("pallas_gpu", attention=_pallas_gpu.attention, diff_attention=_pallas_gpu.diff_attention,
         platforms=("gpu",), available=_pallas_gpu.triton_available, blocks=_pallas_gpu.block_kernels)
register("pallas_tpu", attention=_pallas_tpu.attention, diff_attention=_pallas_tpu.diff_attention,
         platforms=("tpu",), blocks=_pallas_tpu.block_kernels)
# JAX's Pallas TPU flash attention for the standard op (the baseline, DIFF V2): "auto" takes it on TPU.
register("tpu_flash", attention=_tpu_flash.attention, platforms=("tpu",), auto_rank=1)
register("cudnn", attention=_cudnn.attention, diff_attention=_cudnn.diff_attention, platforms=("gpu",),
         auto_rank=0, dtypes=("bfloat16", "float16"))

"""One attention op, several implementations chosen by name: `IMPLS`, and "auto"'s order per platform and op,
`AUTO`, which "xla" (the reference, the oracle) ends (shapes and registry: docs/design.md §4). Kernels are chosen for
the *target* platform, the one `targeting` sets (`sharding.MeshJit` sets its mesh's) else this host's backend, so a CPU
host compiling for a TPU or GPU traces the kernels that hardware would run; `recording` collects what each op got.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

import jax

from diffjax.kernels import causal_blocks, cudnn, mosaic_gpu, pallas_gpu, pallas_tpu, reference, tpu_flash

FEATURES = ("sinks",)  # sinks: a per-head sink logit in `attention`'s softmax denominator (reference.attention_probs)


@dataclasses.dataclass(frozen=True)
class Impl:
    attention: Callable | None = None
    diff_attention: Callable | None = None
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")  # where it runs outside Pallas interpret mode
    available: Callable[[], bool] = lambda: True  # noqa: E731  (any further condition on this JAX)
    dtypes: tuple[str, ...] | None = None  # input dtypes it takes (None: any)
    features: tuple[str, ...] = ()  # the FEATURES its ops take
    blocks: Callable | None = None  # interpret -> its kernels on a block of a split sequence (fused_blocks.py)
    auto_when: Callable[[], bool] = lambda: True  # noqa: E731  (whether "auto" may take it: a measurement says so)


def _pallas(name: str):
    """The platform's Pallas kernel: Mosaic on TPU, Triton elsewhere (with interpret=True, how it runs on CPU)."""
    return lambda *args, **kw: getattr(pallas_tpu if platform() == "tpu" else pallas_gpu, name)(*args, **kw)


IMPLS: dict[str, Impl] = {
    "xla": Impl(reference.attention, reference.diff_attention, features=("sinks",)),
    # the reference math in causal query blocks that skip masked keys, faster on CPU for T > 128; named only
    "causal_blocks": Impl(causal_blocks.attention, causal_blocks.diff_attention, features=("sinks",)),
    "pallas": Impl(_pallas("attention"), _pallas("diff_attention"), ("gpu", "tpu"), blocks=_pallas("block_kernels"),
                   available=lambda: platform() == "tpu" or pallas_gpu.triton_available()),
    "pallas_gpu": Impl(pallas_gpu.attention, pallas_gpu.diff_attention, ("gpu",), pallas_gpu.triton_available,
                       blocks=pallas_gpu.block_kernels),
    "pallas_tpu": Impl(pallas_tpu.attention, pallas_tpu.diff_attention, ("tpu",), blocks=pallas_tpu.block_kernels),
    "tpu_flash": Impl(tpu_flash.attention, platforms=("tpu",)),  # JAX's Pallas TPU flash attention
    "cudnn": Impl(cudnn.attention, cudnn.diff_attention, ("gpu",), dtypes=("bfloat16", "float16")),
    # the fused kernels on Mosaic GPU (Hopper: wgmma, TMA, warp-specialized); "auto" takes it once a device check
    # measured it faster than cuDNN's composition (mosaic_gpu_tuned.json)
    "mosaic_gpu": Impl(mosaic_gpu.attention, mosaic_gpu.diff_attention, ("gpu",), mosaic_gpu.available,
                       dtypes=("bfloat16", "float16"), auto_when=mosaic_gpu.measured_faster),
    # FlashDiffAttn_1: two cuDNN calls with V of width 2d (Hopper, cuDNN >= 9.10); named only until measured
    "cudnn_wide_v": Impl(diff_attention=cudnn.diff_attention_wide_v, platforms=("gpu",),
                         dtypes=("bfloat16", "float16")),
}

# "auto": per platform and op, the impls to try in order ("split": for the blocks of a sequence split over devices).
# On a GPU, cuDNN's DIFF composition was measured faster than the Triton kernel (docs/kernels.md, "How auto chooses");
# the Mosaic GPU kernel comes first only where a device check measured it faster than cuDNN (`Impl.auto_when`).
AUTO: dict[str, dict[str, tuple[str, ...]]] = {
    "gpu": {"diff_attention": ("mosaic_gpu", "cudnn", "pallas"), "attention": ("cudnn",), "split": ("pallas",)},
    "tpu": {"diff_attention": ("pallas",), "attention": ("tpu_flash",), "split": ("pallas",)},
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
    """Add an impl (the fields of `Impl`): a quantized variant, a user's kernel (docs/design.md, extension points)."""
    if not set(fields.get("features", ())) <= set(FEATURES):
        raise ValueError(f"impl {name!r}: unknown features {fields['features']}; known: {FEATURES}")
    IMPLS[name] = Impl(**fields)


def names() -> list[str]:
    return ["auto", *IMPLS]


def implements(impl: str, op: str, features=()) -> bool:
    """Whether `impl` ("auto" always does, through xla) has a function for `op` that takes `features`."""
    return impl == "auto" or (impl in IMPLS and getattr(IMPLS[impl], op) is not None
                              and set(features) <= set(IMPLS[impl].features))


def has_blocks(impl: str, op: str) -> bool:
    """Whether `impl` has kernels for `op` on one block of a split sequence (the fused Pallas kernels do)."""
    return impl in IMPLS and IMPLS[impl].blocks is not None and implements(impl, op)


def _usable(impl: str, dtype=None) -> bool:
    entry = IMPLS[impl]
    takes = entry.dtypes is None or dtype is None or str(jax.numpy.dtype(dtype)) in entry.dtypes
    return takes and platform() in entry.platforms and entry.available()


def candidates(op: str, target: str | None = None, dtype=None, features=(), split: bool = False) -> list[str]:
    """What "auto" tries for `op` on `target` (default: the current one) with inputs of `dtype` and the call's
    `features`, in order, "xla" last (the first is its choice); with `split`, for the blocks of a split sequence."""
    with targeting(target or platform()):
        order = AUTO.get(platform(), {}).get("split" if split else op, ())
        found = [n for n in order if implements(n, op, features) and _usable(n, dtype)
                 and (not split or has_blocks(n, op)) and IMPLS[n].auto_when()]
    return [*found, "xla"]


def choice(impl: str, op: str, target: str, dtype="bfloat16", features=()) -> str:
    """The impl that `impl` names for `op` on `target`: itself, or "auto"'s choice there."""
    return impl if impl != "auto" else candidates(op, target, dtype, features)[0]


def split_choice(impl: str, op: str, target: str, dtype="bfloat16") -> str:
    """The impl computing `op`'s blocks of a sequence split over devices on `target` (`choice` for the split)."""
    return impl if impl != "auto" else candidates(op, target, dtype, split=True)[0]


def split_label(impl: str, op: str, label: str) -> str:
    """What computes a split `op` under `impl`: "<impl> blocks <label>", or "xla <label>" (the reference per block)."""
    return f"{impl} blocks {label}" if has_blocks(impl, op) else f"xla {label}"


def resolve(impl: str, op: str, *, interpret: bool = False, dtype=None, features=()) -> Callable:
    """The function computing `op` for `impl` with inputs of `dtype` and the call's `features` (naming an impl
    without one is an error). `interpret=True` skips a named impl's platform check (Pallas in interpret mode)."""
    if impl == "auto":
        impl = candidates(op, dtype=dtype, features=features)[0]
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; known: {names()}")
    if getattr(IMPLS[impl], op) is None:
        raise ValueError(f"attention impl {impl!r} does not implement {op}")
    if not implements(impl, op, features):
        raise ValueError(f"attention impl {impl!r} does not support {', '.join(features)} in {op}; use 'auto' or "
                         f"one of {[n for n in IMPLS if implements(n, op, features)]}")
    if not interpret and not _usable(impl):
        raise ValueError(f"attention impl {impl!r} is not available on platform {platform()!r}")
    record(op, impl)
    return getattr(IMPLS[impl], op)


def split_blocks(impl: str, op: str, *, interpret: bool = False, dtype=None, label: str = ""):
    """For `op` on a sequence split over devices (`context_parallel.py`): the block kernels of `split_choice`'s impl,
    or None where that is "xla" and the split runs the reference per block. Records `split_label`."""
    name = candidates(op, dtype=dtype, split=True)[0] if impl == "auto" else impl
    resolve(name, op, interpret=interpret, dtype=dtype)  # the same checks as an unsplit call
    record(op, split_label(name, op, label))
    return IMPLS[name].blocks(interpret) if has_blocks(name, op) else None


def diff_attention(q1, q2, k1, k2, v, lam, *, causal=True, segment_ids=None, impl="auto", interpret=False):
    fn = resolve(impl, "diff_attention", interpret=interpret, dtype=q1.dtype)
    return fn(q1, q2, k1, k2, v, lam, causal=causal, segment_ids=segment_ids, interpret=interpret)


def attention(q, k, v, *, causal=True, segment_ids=None, sinks=None, impl="auto", interpret=False):
    extra = {} if sinks is None else {"sinks": sinks}  # impls without the feature never see the keyword
    fn = resolve(impl, "attention", interpret=interpret, dtype=q.dtype, features=tuple(extra))
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, **extra, interpret=interpret)

"""Accelerator targets by the names people use (`v5e-16`, `v5p-8`, `h100x8`), mapped to compile-only devices that
carry the real chip's kind (docs/design.md §3, "Compiling for a target"). As Cloud TPU, v4-N and v5p-N count
TensorCores (two per chip, one megacore device), v5e-N and v6e-N chips."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from importlib import resources

from diffjax.config import ConfigError

GIB = 1024**3

# A compile-only host has no CUDA driver to check the CUDA plugin against (without this the plugin registers no GPU
# compiler) and no TPU chip for libtpu to lock (parallel compiles must not block each other). Both are read when JAX
# starts its backends: import this module before that.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

@contextlib.contextmanager
def uncached():
    """Compiles for a target kept out of JAX's persistent compilation cache (the test suite's): no client here can
    load their executables back, and reading one warns."""
    import jax

    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # writes only what compiles slower
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


# The 3D (v4, v5p) or 2D (v5e, v6e) chip layouts of the slice sizes Cloud TPU offers.
_CUBES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
          512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_PLANES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class _Generation:
    prefix: str  # libtpu's topology name prefix
    cores_per_chip: int  # Cloud TPU's N in "v4-N" counts cores
    hbm_bytes: int  # per chip (= per device: megacore chips are one device)
    layouts: dict


_TPU = {
    "v4": _Generation("v4", 2, 32 * GIB, _CUBES),
    "v5p": _Generation("v5", 2, 95 * GIB, _CUBES),
    "v5e": _Generation("v5e", 1, 16 * GIB, _PLANES),
    "v6e": _Generation("v6e", 1, 32 * GIB, _PLANES),
}
_GPU = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb"}  # GpuTargetConfig per GPU model
_GPU_COUNTS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "tpu" | "gpu"
    topology: str  # libtpu topology name, or the GPU "slices x hosts x devices" string
    num_slices: int
    hbm_bytes: int  # memory a step may use per device (a GPU's: JAX's allocator share of it)
    megacore: bool = False  # two TensorCores per chip as one device (v4, v5p)


def known_names() -> list[str]:
    tpu = [f"{g}-{chips * gen.cores_per_chip}" for g, gen in _TPU.items() for chips in gen.layouts]
    return tpu + [f"{gpu}x{n}" for gpu in _GPU for n in _GPU_COUNTS]


def parse(name: str, num_slices: int = 1) -> Target:
    """`"v5e-16"` / `"h100x8"` (with `num_slices` slices or GPU nodes) -> Target; else ConfigError."""
    if num_slices < 1:
        raise ConfigError(f"--num-slices must be >= 1, got {num_slices}")
    tpu, gpu = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name), re.fullmatch(r"(h100|a100)x(\d+)", name)
    if tpu and int(tpu[2]) % _TPU[tpu[1]].cores_per_chip == 0:
        gen = _TPU[tpu[1]]
        chips = int(tpu[2]) // gen.cores_per_chip
        if chips in gen.layouts:
            return Target(name, "tpu", f"{gen.prefix}:{gen.layouts[chips]}", num_slices, gen.hbm_bytes,
                          megacore=gen.cores_per_chip == 2)
    if gpu and int(gpu[2]) in _GPU_COUNTS:
        memory = int(re.search(r"device_memory_size:\s*(\d+)", _gpu_spec(gpu[1]))[1])
        return Target(name, "gpu", f"1x{num_slices}x{gpu[2]}", num_slices, int(memory * gpu_memory_fraction()))
    raise ConfigError(f"unknown target {name!r}; known: {', '.join(known_names())} (several slices or GPU nodes: "
                      f"--num-slices)")


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory a step may use: JAX's allocator's (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


@functools.cache
def _gpu_spec(gpu: str) -> str:
    return resources.files("diffjax.aot").joinpath("gpu_specs", _GPU[gpu]).read_text()


def devices(target: Target) -> list:
    """The target's compile-only devices (jax.Device objects with the real chip's kind; nothing runs on them)."""
    from jax.experimental import topologies

    from diffjax import host

    try:
        with host.stderr_silenced():  # libtpu's C++ warnings about the TPU hosts this host is not
            return _topology(target, topologies)
    except (ImportError, RuntimeError, NotImplementedError, ValueError) as e:
        need = "jax[tpu] (libtpu)" if target.platform == "tpu" else "jax-cuda12-plugin and jax-cuda12-pjrt"
        raise TargetUnavailable(f"cannot build {target.name} devices on this host ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200]}); install {need} at this jax version: "
                                f"pip install 'diffjax[compile]'") from e


def _topology(target: Target, topologies) -> list:
    if target.platform == "tpu":
        kwargs = {"chip_config_name": "megacore"} if target.megacore else {}
        if target.topology.endswith(":1x1"):  # a single chip is its own host
            kwargs["chips_per_host_bounds"] = (1, 1, 1)
        if target.num_slices > 1:
            kwargs["num_slices"] = target.num_slices
        return list(topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **kwargs).devices)
    gpu = target.name.split("x")[0]
    return list(topologies.get_topology_desc("aot", "cuda", target_config=_gpu_spec(gpu),
                                             topology=target.topology).devices)


@contextlib.contextmanager
def capability_of(devices: list):
    """JAX's cuDNN attention asks the host's first GPU for its compute capability (a V wider than Q and K needs
    Hopper): while tracing for compile-only GPU `devices`, they answer. A no-op for other targets."""
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    if capability is None:
        yield
        return
    # jax._src: the module whose capability checks `jax.nn.dot_product_attention` calls; no public API sets them
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    version = lambda text: tuple(int(x) for x in text.split("."))  # noqa: E731
    patched = {"check_compute_capability": lambda wanted: version(capability) >= version(wanted),
               "is_cuda_compute_capability_equal": lambda wanted: version(capability) == version(wanted)}
    saved = {name: getattr(cudnn_attention, name) for name in patched}
    try:
        for name, fn in patched.items():
            setattr(cudnn_attention, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(cudnn_attention, name, fn)


class TargetUnavailable(RuntimeError):
    """The host lacks the compiler plugin for a target (libtpu or the CUDA plugin)."""

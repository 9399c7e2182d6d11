"""Mesh, logical-axis rules and shardings for parameters, activations, optimizer state and batches (docs/design.md
§3). A dimension that its mesh axis does not divide is replicated instead, so tiny models run on any mesh."""

from __future__ import annotations

import contextlib
import functools
import math

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import kernels
from diffjax.config import ConfigError, MeshConfig

# `sweep` stacks the members of a vmapped sweep (size 1 in a run). `context` sits next to `tensor`, the innermost
# axes getting the nearest devices: both communicate inside every layer (K/V across the split, partial sums).
AXES = ("sweep", "data", "fsdp", "context", "tensor")
BATCH = ("data", "fsdp")  # the batch dimension is split over both data-parallel axes

LOGICAL_RULES = (  # the model's logical axis names -> mesh axes: parameters', then activations'
    ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor"),
    ("norm", None), ("layers", None),
    ("activation_batch", BATCH), ("activation_length", "context"), ("activation_embed", None),
)


def make_mesh(cfg: MeshConfig, devices=None, *, sweep: int = 1) -> jax.sharding.Mesh:
    """The sweep × data × fsdp × context × tensor mesh (`sweep` > 1 only for a sweep that shards its members)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [sweep, cfg.data, cfg.fsdp, cfg.context, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigError(f"mesh: {len(devices)} devices are not divisible by the fixed axes "
                              f"sweep×data×fsdp×context×tensor = {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) > len(devices):
        raise ConfigError(f"mesh: sweep×data×fsdp×context×tensor = {sizes} needs {math.prod(sizes)} devices, "
                          f"have {len(devices)}")
    devices = devices[: math.prod(sizes)]  # explicit sizes may ask for fewer devices than there are
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:  # TPU multislice: data parallelism spans the slices over the data-center network
        if sizes[1] % slices:
            raise ConfigError(f"mesh.data: {sizes[1]} must be a multiple of the {slices} slices (data parallelism "
                              f"spans slices; the other axes stay within one)")
        dcn = (1, slices, 1, 1, 1)
        ici = tuple(size // n for size, n in zip(sizes, dcn, strict=True))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return jax.sharding.Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def _fit(spec: P, shape, mesh) -> P:
    """Drop mesh axes that do not divide their dimension (replicate that dimension instead)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in names)
        fitted.append(axes if names and dim % size == 0 else None)
    return P(*fitted)


def param_shardings(boxed_abstract_params, mesh):
    """NamedShardings for a tree of boxed (logically partitioned) parameter shapes."""
    specs = nn.get_partition_spec(boxed_abstract_params)
    mesh_specs = nn.logical_to_mesh(specs, LOGICAL_RULES)
    shapes = nn.meta.unbox(boxed_abstract_params)
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)), mesh_specs, shapes,
                        is_leaf=lambda x: isinstance(x, P))


def constrain(x, logical_axes: tuple[str, ...]):
    """Constrain an activation's sharding by logical axis names under the context mesh; a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return x
    spec = nn.logical_to_mesh_axes(logical_axes, LOGICAL_RULES)
    return jax.lax.with_sharding_constraint(x, _fit(spec, x.shape, mesh))


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices ("cpu", "gpu", "tpu"), compile-only (deviceless) devices included."""
    return kernels.normalize_platform(mesh.devices.flat[0].platform)


class MeshJit:
    """`jax.jit(fn, **kwargs)` whose traces run under `jax.set_mesh(mesh)`, so the model sees the mesh, with the
    attention kernels chosen for the mesh's devices (not this host's backend)."""

    def __init__(self, fn, mesh, **jit_kwargs):
        self.jitted, self.mesh = jax.jit(fn, **jit_kwargs), mesh

    @contextlib.contextmanager
    def _context(self):
        with jax.set_mesh(self.mesh), kernels.targeting(mesh_platform(self.mesh)):
            yield

    def __call__(self, *args):
        with self._context():
            return self.jitted(*args)

    def lower(self, *args):
        with self._context():
            return self.jitted.lower(*args)


def mesh_of(tree) -> jax.sharding.Mesh:
    """The mesh `tree`'s arrays are placed on (a restored run's: an evaluation under it splits like training), else
    a mesh of this host's first device (arrays on one device, or NumPy)."""
    mesh = getattr(getattr(jax.tree.leaves(tree)[0], "sharding", None), "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) else make_mesh(MeshConfig(data=1), jax.devices()[:1])


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH))


def batch_divisor(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


@functools.lru_cache(maxsize=64)  # asked for every batch; a mesh's devices do not change
def is_local(mesh) -> bool:
    """Whether every device of `mesh` belongs to this process (always, in a single-process run)."""
    return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


def process_share(mesh) -> tuple[int, int]:
    """(index, count): which of `count` equal slices of the global batch this process feeds on `mesh` (processes
    whose devices hold the same rows, replicated over `tensor` and `sweep`, read the same data)."""
    n = batch_divisor(mesh)
    rows = {}  # process -> the row blocks of the global batch its devices hold
    for device, (block,) in batch_sharding(mesh).devices_indices_map((n,)).items():
        rows.setdefault(device.process_index, set()).add(block.start or 0)
    shares = sorted({tuple(sorted(r)) for r in rows.values()})
    mine = tuple(sorted(rows[jax.process_index()]))
    if any(len(r) != n // len(shares) or r != tuple(range(r[0], r[0] + len(r))) for r in shares):
        raise ConfigError(f"mesh {dict(mesh.shape)}: each process must hold one contiguous, equal share of the batch "
                          f"(data × fsdp devices in process order); got row blocks {shares}")
    return shares.index(mine), len(shares)


def put_batch(batch: dict[str, np.ndarray], mesh, sharding: NamedSharding | None = None) -> dict[str, jax.Array]:
    """This process's rows of the global batch -> one global array per key, split over (data, fsdp) unless
    `sharding` says otherwise (a sweep's stacked per-member batches)."""
    sharding = sharding or batch_sharding(mesh)
    if is_local(mesh):
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

"""How a sweep chunk steps its stacked members: all at once, or one after another inside one compiled program.

    execution = resolve(sweep.options.execution, mesh)      # "vmap" | "serial"
    fn = over_members(member_fn, (0, None, 0), execution)    # called like jax.vmap(member_fn, in_axes=...)

`vmap`: `jax.vmap(fn, spmd_axis_name="sweep")` — one batched program. `serial`: `jax.lax.map` over the member
axis — the same unbatched computation a single run compiles, looped over the members inside one jitted program,
so a group still compiles once. Both take and return the same stacked [members, ...] trees, so checkpoints,
metrics and resume do not depend on the choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from diffjax import sharding


def resolve(execution: str, mesh) -> str:
    """`auto` by platform: `serial` on CPU, where XLA:CPU's batched kernels are no faster than unbatched ones (a
    vmapped group of 8 ran 0.64× as fast per token as single runs: docs/benchmarks.md, "Sweep"), so looping costs
    nothing per member-step; `vmap` on GPU / TPU, where one small model leaves the device idle, and whenever the
    members are sharded over the `sweep` mesh axis (their devices step them in parallel; an explicit `serial`
    there is refused at load, `SweepOptions.validate`)."""
    if execution != "auto":
        return execution
    return "serial" if sharding.mesh_platform(mesh) == "cpu" and mesh.shape["sweep"] == 1 else "vmap"


def over_members(fn: Callable, in_axes: Sequence[int | None], execution: str) -> Callable:
    """`fn` over the leading member axis of the arguments whose `in_axes` entry is 0 (None: shared by all
    members); outputs stacked on a leading member axis."""
    if any(axis not in (0, None) for axis in in_axes):
        raise ValueError(f"over_members: in_axes must be 0 or None, got {in_axes}")
    if execution == "vmap":
        return jax.vmap(fn, in_axes=tuple(in_axes), spmd_axis_name="sweep")

    def serial(*args):
        mapped = tuple(a for a, axis in zip(args, in_axes, strict=True) if axis == 0)

        def one(member):
            member = iter(member)
            return fn(*(next(member) if axis == 0 else a for a, axis in zip(args, in_axes, strict=True)))

        return jax.lax.map(one, mapped)

    return serial

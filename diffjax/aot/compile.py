"""Compile `diffjax train`'s exact step for an accelerator target on a host without one (`diffjax compile`): abstract
arguments on the target's compile-only devices, the target's own compiler, its per-device memory plan back
(docs/design.md §3, "Compiling for a target")."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from diffjax import checks, kernels, sharding
from diffjax.aot import targets
from diffjax.config import Config, ConfigError
from diffjax.data.pipeline import BATCH_KEYS
from diffjax.flops import train_flops_per_token
from diffjax.model import archs
from diffjax.train.loss import resolved_chunk
from diffjax.train.members import Members, Stack, check_batch
from diffjax.train.metrics import peak_flops_per_device
from diffjax.train.optim import make_optimizer
from diffjax.train.state import state_shardings

GIB = 1024**3
_BATCH_DTYPES = {"loss_mask": jnp.float32}  # the other batch arrays are int32 (diffjax.data.pipeline)
PARTS = ("parameters", "optimizer", "batch", "other inputs", "outputs", "temporaries", "generated code")

# libtpu's refusals: "... the total memory required for HLO temporaries (50.15G) exceeds available HBM (15.75G)"
# and "Ran out of memory in memory space hbm. Used 30.62G of 15.75G hbm." (temporaries, or everything, vs usable).
_TPU_OOM = (re.compile(r"HLO (temporaries) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"),
            re.compile(r"(Used) ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm"))
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclasses.dataclass
class Report:
    target: str
    devices: int
    device_kind: str
    mesh: dict
    kernels: dict  # op -> the impl the traced step really called
    fits: bool
    memory: dict  # bytes per device: each of PARTS, their total, and the device's capacity
    tokens_per_step: int
    flops_per_step: float
    ideal_step_s: float | None  # the step at the devices' peak FLOP/s (a lower bound)
    compile_s: float
    compiler_error: str | None = None  # the compiler's own out-of-memory message

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def target_mesh(cfg: Config, devices: list, target: targets.Target):
    """The run's data × fsdp × context × tensor mesh over *all* of the target's devices (a whole pod slice)."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "context": cfg.mesh.context, "tensor": cfg.mesh.tensor}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    want = fixed if -1 not in sizes.values() else None
    if (want is not None and want != len(devices)) or (want is None and len(devices) % fixed):
        raise ConfigError(f"mesh: data×fsdp×context×tensor = {tuple(sizes.values())} does not match {target.name}'s "
                          f"{len(devices)} devices; set one axis to -1 or sizes whose product is {len(devices)}")
    return sharding.make_mesh(cfg.mesh, devices)


def abstract_batch(cfg: Config, mesh) -> dict:
    """The global batch as shapes with the loop's batch sharding (what `sharding.put_batch` makes)."""
    shape, batch = (cfg.data.batch_size, cfg.data.seq_len), sharding.batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(shape, _BATCH_DTYPES.get(k, jnp.int32), sharding=batch) for k in BATCH_KEYS}


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded shapes (the largest shard of each leaf)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape) if isinstance(leaf.sharding, NamedSharding)
                         else leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass
class Lowered:
    """`diffjax train`'s step lowered for a target, ready for the target's compiler."""

    cfg: Config  # checked
    step: jax.stages.Lowered
    devices: list
    mesh: object
    kernels: dict  # op -> the impl the traced step really called
    memory: dict  # bytes per device: parameters, optimizer, batch, and the device's capacity
    lower_s: float


def lower_train_step(cfg: Config, target: targets.Target) -> Lowered:
    """Trace and lower `diffjax train`'s step for `target` (ConfigError for a config or mesh the target cannot take,
    targets.TargetUnavailable when this host lacks the target's compiler)."""
    cfg = checks.check(cfg)
    devices = targets.devices(target)
    mesh = target_mesh(cfg, devices, target)
    check_batch(cfg, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    with kernels.targeting(target.platform), targets.capability_of(devices):
        abstract, shardings = state_shardings(cfg, mesh, tx)
    batch = abstract_batch(cfg, mesh)
    stack = Stack(Members.run(cfg, Path(cfg.train.workdir)), mesh, tx, abstract, shardings)  # what `train` steps
    memory = {"parameters": per_device_bytes(abstract.params), "optimizer": per_device_bytes(abstract.opt_state),
              "batch": per_device_bytes(batch), "capacity": target.hbm_bytes}
    start = time.perf_counter()
    with kernels.recording() as used, targets.capability_of(devices):
        lowered = stack.train_fn().lower(stack.abstract, batch)
    return Lowered(cfg, lowered, devices, mesh, {op: used.get(op, "none") for op in archs.get(cfg.model.arch).ops},
                   memory, time.perf_counter() - start)


def compile_train_step(cfg: Config, target: targets.Target) -> Report:
    """Compile `diffjax train`'s step for `target`; a Report whether it fits or not (errors: `lower_train_step`)."""
    lowered = lower_train_step(cfg, target)
    cfg, devices, mesh, memory = lowered.cfg, lowered.devices, lowered.mesh, lowered.memory
    start = time.perf_counter() - lowered.lower_s
    error = None
    try:
        with targets.uncached():
            analysis = lowered.step.compile().memory_analysis()
        # Every part XLA counts, so the parts add up to the total: the inputs (the state and batch above, plus
        # scalars such as the step and RNG), outputs not written in place of an input, temporaries, the program.
        known = memory["parameters"] + memory["optimizer"] + memory["batch"]
        memory["other inputs"] = analysis.argument_size_in_bytes - known
        memory["outputs"] = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        memory["temporaries"] = analysis.temp_size_in_bytes
        memory["generated code"] = analysis.generated_code_size_in_bytes
        memory["total"] = sum(memory[k] for k in PARTS)
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program over HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        error = str(e).splitlines()[0][:400]
        _read_tpu_oom(str(e), memory)
    compile_s = time.perf_counter() - start
    fits = error is None and memory["total"] <= memory["capacity"]
    tokens = cfg.data.batch_size * cfg.data.seq_len
    flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    peak = peak_flops_per_device(devices[0])
    return Report(target=target.name if target.num_slices == 1 else f"{target.name} × {target.num_slices}",
                  devices=len(devices), device_kind=devices[0].device_kind, mesh=dict(mesh.shape),
                  kernels=lowered.kernels, fits=fits, memory=memory, tokens_per_step=tokens, flops_per_step=flops,
                  ideal_step_s=flops / (peak * len(devices)) if peak else None, compile_s=compile_s,
                  compiler_error=error)


def _read_tpu_oom(message: str, memory: dict) -> None:
    """Fill temporaries / total / capacity from libtpu's out-of-memory message, where it states them."""
    arguments = memory["parameters"] + memory["optimizer"] + memory["batch"]
    for pattern in _TPU_OOM:
        if found := pattern.search(message):
            what, amount, unit, capacity, cap_unit = found.groups()
            amount = int(float(amount) * _UNITS[unit])
            memory["capacity"] = int(float(capacity) * _UNITS[cap_unit])
            memory["temporaries"] = amount if what == "temporaries" else max(0, amount - arguments)
            memory["total"] = arguments + memory["temporaries"]
            return


def advice(report: Report, cfg: Config) -> str:
    """A plain sentence for a step that does not fit: the biggest part and what to try."""
    m = report.memory
    parts = {k: m.get(k, 0) for k in ("parameters", "optimizer", "temporaries")}
    biggest = max(parts, key=parts.get)
    tips = []
    if biggest in ("parameters", "optimizer") or cfg.mesh.fsdp == 1:
        tips.append("shard parameters and optimizer state over the slice (--set mesh.data=1 --set mesh.fsdp=-1)")
    if cfg.model.remat != "full":
        tips.append("recompute activations (--set model.remat=full)")
    mesh = report.mesh
    chunk = resolved_chunk(cfg.model, cfg.data.batch_size // (mesh["data"] * mesh["fsdp"]),
                           cfg.data.seq_len // mesh["context"])
    if not chunk:
        tips.append("chunk the loss (--set model.loss_chunk=512)")
    elif chunk > 64:
        tips.append(f"smaller loss chunks (--set model.loss_chunk={chunk // 4}; now {chunk})")
    tips.append("a smaller per-step batch (--set optim.grad_accum=2, or a smaller data.batch_size)")
    total = m.get("total")
    over = f"needs {total / GIB:.2f} GiB" if total else "does not fit"
    return (f"does not fit: the step {over} per device of {m['capacity'] / GIB:.2f} GiB; the biggest part is "
            f"{biggest} ({parts[biggest] / GIB:.2f} GiB). Try: " + "; ".join(tips) + ".")

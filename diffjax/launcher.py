"""What a launcher (SLURM, Open MPI) gives this process, read from its environment alone (no jax): whether the run is
several processes, and which of the node's GPUs this process owns.

JAX's own cluster detection gives a task of a SLURM or Open MPI launch the one GPU of its local rank
(`local_device_ids=[SLURM_LOCALID]`, jax/_src/clusters/cluster.py): right for a task per GPU, but a task per node
then drives GPU 0 alone. Here a process owns its share of the GPUs it sees: all of them as the node's only task,
`gpus / tasks` of them (the local rank's) when the node's tasks see the same GPUs, and all it sees when the launcher
bound each task to its own (fewer GPUs than tasks on the node: `--gpus-per-task`, `--gpu-bind`)."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

from diffjax import host
from diffjax.config import ConfigError


def says_multi_process(env=os.environ) -> bool:
    """A launcher started several processes (or `DIFFJAX_DISTRIBUTED=1` says so)."""
    return (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
            or "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("DIFFJAX_DISTRIBUTED", "") == "1")


@dataclasses.dataclass(frozen=True)
class Launch:
    launcher: str  # "SLURM" or "Open MPI"
    tasks: int  # the launch's tasks on this node
    local_rank: int  # this task's index among them
    gpus: int | None  # the GPUs this task sees; None: none that the launcher or the driver names
    gpus_from: str  # where `gpus` was read

    def device_ids(self) -> list[int] | None:
        """The local GPU ids this process should own (for `jax.distributed.initialize`); None without GPUs."""
        if self.gpus is None:
            return None
        if self.tasks == 1 or self.gpus < self.tasks:  # the node's only task, or bound to its own GPUs
            return list(range(self.gpus))
        if self.gpus % self.tasks:
            raise ConfigError(f"{self.describe()}: {self.gpus} GPUs do not split evenly between {self.tasks} tasks; "
                              f"launch one task per node or one per GPU")
        share = self.gpus // self.tasks
        return list(range(self.local_rank * share, (self.local_rank + 1) * share))

    def describe(self) -> str:
        return f"{self.launcher}: task {self.local_rank} of {self.tasks} on this node, {self.gpus_from}"


def detect(env=os.environ) -> Launch | None:
    """This process's place in a SLURM or Open MPI launch (the variables JAX's detection reads), or None."""
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                              "SLURM_LOCALID")):
        name, spec = next(((k, env[k]) for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                                  "SLURM_NTASKS_PER_NODE") if env.get(k)), ("", "1"))
        tasks = _tasks_on_node(name, spec, _int(env, "SLURM_NODEID", "0"))
        launcher, local_rank = "SLURM", _int(env, "SLURM_LOCALID")
    elif "OMPI_COMM_WORLD_LOCAL_RANK" in env:
        launcher, local_rank = "Open MPI", _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        tasks = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    else:
        return None
    gpus, gpus_from = _visible_gpus(env)
    return Launch(launcher, tasks, local_rank, gpus, gpus_from)


def _visible_gpus(env) -> tuple[int | None, str]:
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [i for i in env["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
        return len(ids) or None, f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"
    if env.get("SLURM_GPUS_ON_NODE"):
        return _int(env, "SLURM_GPUS_ON_NODE"), f"SLURM_GPUS_ON_NODE={env['SLURM_GPUS_ON_NODE']}"
    nodes = glob.glob(host.NVIDIA_DEVICES)
    return (len(nodes), f"{len(nodes)} GPUs in /dev") if nodes else (None, "no GPUs")


def _tasks_on_node(name: str, spec: str, node: int) -> int:
    """SLURM's tasks-per-node list ("4(x2),2": 4 on the first two nodes, 2 on the third) at `node`."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"{name}={spec!r}: expected counts like '4(x2),2'")
        counts += [int(m[1])] * int(m[2] or 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"{name}={spec!r} has no entry for SLURM_NODEID={node}")
    return counts[node]


def _int(env, name: str, default: str | None = None) -> int:
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None

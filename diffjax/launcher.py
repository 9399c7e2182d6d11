"""What a launcher (SLURM, Open MPI) gives this process, read from its environment alone (no jax): whether the run is
several processes, and which of the node's GPUs this process owns.

JAX's own cluster detection gives a task of a SLURM or Open MPI launch the one GPU of its local rank
(`local_device_ids=[SLURM_LOCALID]`, jax/_src/clusters/cluster.py): right for a task per GPU, but a task per node
then drives GPU 0 alone. Here a process owns its share of the GPUs it sees, so that every GPU of the step is driven
by exactly one process:

- the node's tasks see the same GPUs (no binding: one task per node, `--ntasks-per-node` with `--gpus-per-node`):
  each owns `gpus / tasks` of them, its local rank's;
- SLURM bound each task to some of the step's GPUs (`--gpus-per-task=N`, which implies
  `--tres-bind=gres/gpu:per_task:N`; `--gpu-bind=...`): each owns all it sees, provided the node's tasks together
  hold each of the step's GPUs once. `--gpu-bind=closest` binds a task to every GPU near its cores (all of a NUMA
  domain's), so 8 tasks on 2 domains see 4 GPUs each: shared, refused.

What SLURM sets, per task (SchedMD/slurm, src/plugins/gres/common/gres_common.c `gres_common_gpu_set_env`, called
for each task by gres_gpu.c `gres_p_task_set_env`; doc/man/man1/srun.1 "OUTPUT ENVIRONMENT VARIABLES";
doc/html/gres.shtml "GPU Management"): `CUDA_VISIBLE_DEVICES`, the GPUs the task may use (its binding's when bound,
else the step's on its node; numbered from 0 among the step's GPUs under cgroup ConstrainDevices, else global ids:
either way the same name for the same GPU in every task of the step on a node); `SLURM_STEP_GPUS`, the same GPUs'
global ids; `SLURM_GPUS_ON_NODE`, the number the step holds on the node, all its tasks together (counted from the
step's allocation, not the task's binding). `SLURM_GPUS_PER_TASK` is only the request, and `SLURM_JOB_GPUS` the
batch node's GPUs (set in batch and interactive jobs), so neither says what a task was given."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import socket

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
    names: tuple[str, ...] = ()  # the GPUs it sees, by the names every task of the step on this node uses for them
    step_gpus: int | None = None  # SLURM_GPUS_ON_NODE: the GPUs the step holds on this node, all tasks together
    node: str = ""  # this node's name

    def device_ids(self) -> list[int] | None:
        """The local GPU ids this process should own (for `jax.distributed.initialize`); None without GPUs."""
        if self.gpus is None:
            return None
        if self.step_gpus is not None and self.gpus < self.step_gpus:  # SLURM bound it to some of the step's
            held = self.tasks * self.gpus  # as every task of the node holds, bound alike (per_task: the same count)
            if held != self.step_gpus:
                problem = (f"the node's {self.tasks} tasks would share its {self.step_gpus} GPUs"
                           if held > self.step_gpus else
                           f"the node's {self.tasks} tasks would leave {self.step_gpus - held} of its "
                           f"{self.step_gpus} GPUs idle")
                raise ConfigError(f"{self.describe()}: SLURM bound this task to {self.gpus} of the step's "
                                  f"{self.step_gpus} GPUs on this node, so {problem}; launch one task per node, one "
                                  f"per GPU (--gpus-per-task=1), or --gpus-per-task=GPUS/TASKS, without "
                                  f"--gpu-bind=closest")
            return list(range(self.gpus))
        if self.tasks == 1 or (self.step_gpus is None and self.gpus < self.tasks):  # the only task, or bound
            return list(range(self.gpus))
        if self.gpus % self.tasks:
            raise ConfigError(f"{self.describe()}: {self.gpus} GPUs do not split evenly between {self.tasks} tasks; "
                              f"launch one task per node or one per GPU")
        share = self.gpus // self.tasks
        return list(range(self.local_rank * share, (self.local_rank + 1) * share))

    def owned(self) -> list[str] | None:
        """The names of the GPUs this process drives (comparable between the tasks of a node), None without."""
        ids = self.device_ids()
        return None if ids is None else [self.names[i] if i < len(self.names) else str(i) for i in ids]

    def describe(self) -> str:
        return f"{self.launcher}: task {self.local_rank} of {self.tasks} on this node, {self.gpus_from}"


def check_placement(placements: list) -> None:
    """Every process's `[node, GPUs it drives, GPUs its step holds on the node]` or None, in process order: refuse a
    launch in which two processes drive the same GPU, or a node's processes leave some of the step's GPUs idle (the
    check across processes that `device_ids` makes from one task's variables alone: tasks bound unevenly)."""
    drivers: dict[tuple[str, str], list[int]] = {}
    held: dict[str, int | None] = {}
    for index, row in enumerate(placements):
        if row is None or row[1] is None:  # no GPUs named, or the user's JAX_LOCAL_DEVICE_IDS
            continue
        node, owned, step_gpus = row
        held[node] = step_gpus
        for gpu in owned:
            drivers.setdefault((node, gpu), []).append(index)
    for (node, gpu), processes in drivers.items():
        if len(processes) > 1:
            raise ConfigError(f"GPU {gpu} of {node} would be driven by processes "
                              f"{', '.join(map(str, processes))}: SLURM gave their tasks the same GPUs "
                              f"(--gpu-bind=closest?); launch one task per node or --gpus-per-task=1")
    for node, step_gpus in held.items():
        driven = sorted(gpu for n, gpu in drivers if n == node)
        if step_gpus is not None and len(driven) < step_gpus:
            raise ConfigError(f"{node}: the job step holds {step_gpus} GPUs there, but its processes drive "
                              f"{len(driven)} ({', '.join(driven)}); {step_gpus - len(driven)} would sit idle")


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
    gpus, gpus_from, names = _visible_gpus(env)
    step_gpus = _int(env, "SLURM_GPUS_ON_NODE") if launcher == "SLURM" and env.get("SLURM_GPUS_ON_NODE") else None
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return Launch(launcher, tasks, local_rank, gpus, gpus_from, names, step_gpus, node)


def _visible_gpus(env) -> tuple[int | None, str, tuple[str, ...]]:
    if "CUDA_VISIBLE_DEVICES" in env:
        names = tuple(i.strip() for i in env["CUDA_VISIBLE_DEVICES"].split(",") if i.strip())
        return len(names) or None, f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", names
    if env.get("SLURM_GPUS_ON_NODE"):
        return _int(env, "SLURM_GPUS_ON_NODE"), f"SLURM_GPUS_ON_NODE={env['SLURM_GPUS_ON_NODE']}", ()
    nodes = glob.glob(host.NVIDIA_DEVICES)
    return (len(nodes), f"{len(nodes)} GPUs in /dev", ()) if nodes else (None, "no GPUs", ())


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

"""Multi-process runs on JAX's distributed runtime: launch, agreement between processes, failure reports
(docs/design.md §3, "Multi-host"; docs/multihost.md)."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import NoReturn

import jax
import numpy as np

from diffjax import launcher
from diffjax.config import ConfigError

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}
DEFAULT_HEARTBEAT_TIMEOUT = 100  # seconds, JAX's own default
_heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT  # the one this process initialized with


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, auto: bool = False, heartbeat_timeout: int | None = None) -> None:
    """Join the run's processes (a no-op for a single process, or when already initialized)."""
    if jax.distributed.is_initialized():
        return
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, name in ENV.items():
        if given[key] is None and os.environ.get(name):
            given[key] = os.environ[name] if key == "coordinator" else _int(name, os.environ[name])
    heartbeat = heartbeat_timeout or _int("DIFFJAX_HEARTBEAT_TIMEOUT",
                                          os.environ.get("DIFFJAX_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT))
    if any(v is not None for v in given.values()):
        missing = [f"--{k.replace('_', '-')} ({ENV[k]})" for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(f"a multi-process launch needs a coordinator, a process count and a process id; "
                              f"missing {', '.join(missing)}")
        if not given["coordinator"].rpartition(":")[2].isdigit():
            raise ConfigError(f"--coordinator must be HOST:PORT, got {given['coordinator']!r}")
        if given["num_processes"] < 1 or not 0 <= given["process_id"] < given["num_processes"]:
            raise ConfigError(f"--process-id {given['process_id']} must lie in [0, --num-processes "
                              f"{given['num_processes']})")
        if given["num_processes"] == 1:
            return
    elif not (auto or launcher.says_multi_process()):
        return
    global _heartbeat_timeout
    _heartbeat_timeout = heartbeat
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPUs / TPUs keep theirs
    jax.config.update("jax_enable_preemption_service", True)  # the processes agree on a stop step through it
    launch = launcher.detect()
    own = os.environ.get("JAX_LOCAL_DEVICE_IDS")  # the user's choice, which JAX reads itself
    ids = launch.device_ids() if launch and not own else None
    jax.distributed.initialize(given["coordinator"], given["num_processes"], given["process_id"],
                               local_device_ids=ids, heartbeat_timeout_seconds=heartbeat)
    if own:
        check_devices(len(own.split(",")), f"JAX_LOCAL_DEVICE_IDS={own}")
    else:
        placement = [launch.node, launch.owned(), launch.step_gpus] if launch and ids is not None else None
        check_devices(None if ids is None else len(ids), launch.describe() if launch else "", placement)


def check_devices(expected: int | None, why: str, placement: list | None = None) -> None:
    """Refuse to start, on every process alike, when a process sees other than the `expected` local devices that
    its launch (`why`) gives it, or the processes see different numbers: the mesh would span a fraction of the
    accelerators the launch holds (and that `diffjax compile` planned for); or when two processes would drive the
    same GPU, or a node's processes leave some of its GPUs idle (`placement`: launcher.check_placement)."""
    seen = gather_json([jax.local_device_count(), expected, jax.default_backend(), why, placement])
    for index, (count, wanted, platform, reason, _) in enumerate(seen):
        if wanted is not None and count != wanted:
            hint = "; is jax installed for the GPU (pip install -e '.[cuda]')?" if platform == "cpu" else ""
            raise ConfigError(f"process {index} of {len(seen)} sees {count} {platform} device(s), but its launch "
                              f"({reason}) gives it {wanted}{hint}")
    if len({count for count, *_ in seen}) > 1:
        counts = ", ".join(f"process {i}: {count}" for i, (count, *_) in enumerate(seen))
        raise ConfigError(f"the processes see different numbers of devices ({counts}); every process of a run "
                          f"must own as many")
    launcher.check_placement([row[4] for row in seen])


def check_mesh(mesh) -> None:
    """Refuse a multi-process run whose mesh leaves devices out (explicit `mesh.*` sizes meant for another launch):
    the launch's accelerators would idle, and a process whose devices are all left out has nowhere to feed its data."""
    if is_multi_process() and mesh.devices.size != jax.device_count():
        sizes = " × ".join(f"{k} {v}" for k, v in mesh.shape.items() if v > 1) or "one device"
        raise ConfigError(f"the mesh ({sizes}) spans {mesh.devices.size} of the {jax.device_count()} devices of this "
                          f"launch ({jax.process_count()} processes × {jax.local_device_count()}); set one mesh axis "
                          f"to -1, or sizes whose product is {jax.device_count()}")


def _int(name: str, value) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def is_main() -> bool:
    """Process 0 writes the run's files (metrics, config, reports); every process takes part in checkpoints."""
    return jax.process_index() == 0


def is_multi_process() -> bool:
    return jax.process_count() > 1


def fetch(tree):
    """The host value of a tree of arrays; an array split over several processes is all-gathered first."""
    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def gather_json(value) -> list:
    """Every process's JSON-able `value`, in process order, on every process (a collective: all must call it)."""
    if not is_multi_process():
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8).astype(np.int32)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.int32)
    padded[: len(data)] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n].astype(np.uint8))) for row, n in zip(rows, lengths, strict=True)]


def check_same(value: dict, what: str) -> None:
    """Refuse to start when the processes were given different `what` (a config as a dict of sections)."""
    values = gather_json(value)
    for index, other in enumerate(values[1:], start=1):
        if other != values[0]:
            fields = ", ".join(f"{k} ({a!r} vs {b!r})" for k, a, b in _differences(values[0], other)[:5])
            raise ConfigError(f"process {index} was launched with a different {what} than process 0: {fields}; "
                              f"every process must run the same command")


def _differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def exit_now(code: int, last_line: str | None = None) -> NoReturn:
    """End this process at once (a normal exit would wait at the runtime's shutdown barrier for processes that may be
    gone), `last_line` the last it prints."""
    sys.stdout.flush()
    sys.stderr.flush()
    stderr, nowhere = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # what the runtime's threads log as it ends (its own account of a lost process) goes nowhere
        os.dup2(nowhere, fd)
    if last_line:
        os.write(stderr, f"{last_line}\n".encode())
    os._exit(code)


def exit_after_failure(error: BaseException) -> NoReturn:
    """End this process of a multi-process run after `error`, the failure's cause last. When processes stopped,
    `error` is only a collective that lost them: one line names them. Otherwise this process's traceback first."""
    gone, cause = describe_failure()
    if not gone:
        traceback.print_exception(error)
        cause = f"{type(error).__name__}: {str(error)[:300]}\n{cause}"
    exit_now(1, f"error in process {jax.process_index()} of {jax.process_count()}: {cause}. Relaunch every process "
                f"to resume from the last checkpoint.")


def describe_failure() -> tuple[list[int], str]:
    """(the processes that are gone, a sentence saying what failed), as the coordinator sees them (it knows once their
    heartbeats stop)."""
    from jax.experimental import multihost_utils

    n, answer, answered = jax.process_count(), {}, threading.Event()

    def ask():
        try:  # live_devices asks again on leaving the block: not waited for (measured: while waiting, the
            # coordination service's error poll ended this process before its line)
            with multihost_utils.live_devices(jax.devices()) as live:
                answer["live"] = {d.process_index for d in live}
                answered.set()
        except Exception as e:  # noqa: BLE001 — the coordinator itself may be gone
            answer["error"] = e
            answered.set()

    # live_devices waits for the live processes to ask too, and for the dead ones' heartbeats to time out
    threading.Thread(target=ask, daemon=True).start()
    answered.wait(timeout=_heartbeat_timeout + 15)
    if "live" in answer:
        gone = sorted(set(range(n)) - answer["live"])
        if gone:
            return gone, f"process(es) {', '.join(map(str, gone))} of {n} stopped (no heartbeat); see their logs"
        return [], f"all {n} processes are alive; one of them failed — see the other processes' logs"
    if "error" in answer:
        return [], f"the coordinator (process 0) is unreachable: {str(answer['error'])[:200]}"
    return [], "could not learn from the coordinator which process stopped"

"""What a SLURM / Open MPI launch gives each process (diffjax/launcher.py), what of it reaches
`jax.distributed.initialize`, and the refusal when the devices a process sees disagree with its launch. The real
two-process SLURM launch is in test_multiprocess.py."""

import jax
import pytest

from diffjax import distributed, launcher, sharding
from diffjax.config import ConfigError, MeshConfig


def slurm(local_id: int = 0, *, tasks: str = "1", **more) -> dict[str, str]:
    """A SLURM task's environment (what srun sets), `tasks` its SLURM_STEP_TASKS_PER_NODE."""
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[001-004]", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
            "SLURM_LOCALID": str(local_id), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": tasks} | more


@pytest.mark.parametrize("env,ids", [
    (slurm(tasks="1(x4)", SLURM_GPUS_ON_NODE="8"), list(range(8))),  # a task per node: all its GPUs
    (slurm(tasks="1", CUDA_VISIBLE_DEVICES="0,1,2,3"), [0, 1, 2, 3]),  # what it sees wins over the node's count
    (slurm(5, tasks="8(x4)", SLURM_GPUS_ON_NODE="8"), [5]),  # a task per GPU: its local rank's
    (slurm(1, tasks="2", SLURM_GPUS_ON_NODE="8"), [4, 5, 6, 7]),  # two tasks share a node: the second half
    (slurm(1, tasks="4(x2),2", SLURM_NODEID="2", SLURM_GPUS_ON_NODE="8"), [4, 5, 6, 7]),  # the third node runs 2
    (slurm(3, tasks="8", CUDA_VISIBLE_DEVICES="3"), [0]),  # bound to its own GPU (--gpus-per-task=1)
    (slurm(3, tasks="4", SLURM_NTASKS_PER_NODE="4", CUDA_VISIBLE_DEVICES=""), None),  # no GPUs: JAX's choice
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
     [2, 3]),
], ids=["task-per-node", "visible", "task-per-gpu", "two-per-node", "uneven-nodes", "bound", "no-gpus", "openmpi"])
def test_a_task_owns_its_share_of_the_gpus_it_sees(env, ids):
    assert launcher.detect(env).device_ids() == ids


def test_no_launcher_and_bad_layouts_are_named():
    assert launcher.detect({"PATH": "/bin"}) is None
    for env, message in [(slurm(tasks="3", SLURM_GPUS_ON_NODE="8"), "8 GPUs do not split evenly between 3 tasks"),
                         (slurm(tasks="2(y3)"), r"SLURM_STEP_TASKS_PER_NODE='2\(y3\)': expected counts"),
                         (slurm(tasks="2", SLURM_NODEID="1"), "no entry for SLURM_NODEID=1"),
                         (slurm(tasks="2", SLURM_GPUS_ON_NODE="eight"), "SLURM_GPUS_ON_NODE must be an integer")]:
        with pytest.raises(ConfigError, match=message):
            launcher.detect(env).device_ids()


@pytest.fixture
def captured(monkeypatch):
    """`jax.distributed.initialize`'s arguments as `distributed.initialize` passes them, the device check's
    expectation beside them; nothing is joined (the CPU collectives setting restored after)."""
    seen = {}
    collectives = jax.config.jax_cpu_collectives_implementation
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kw: seen.update(args=args, **kw))
    monkeypatch.setattr(distributed, "check_devices", lambda expected, why: seen.update(expected=expected, why=why))
    for name in ("CUDA_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS",
                 "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    yield seen
    jax.config.update("jax_cpu_collectives_implementation", collectives)


def test_every_gpu_of_a_slurm_node_reaches_jax_distributed_initialize(captured, monkeypatch):
    from jax._src import clusters  # JAX's own detection: what it makes of the same environment

    env = slurm(tasks="1(x4)", SLURM_GPUS_ON_NODE="8")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    distributed.initialize()  # SLURM_NTASKS=4: a launch of several processes, detected
    assert captured["local_device_ids"] == list(range(8)) and captured["expected"] == 8
    assert captured["why"] == "SLURM: task 0 of 1 on this node, SLURM_GPUS_ON_NODE=8"
    # left to JAX, the task would drive GPU 0 alone; given the ids, JAX keeps them
    detected = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert detected[1:] == (4, 0, [0])
    assert clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, list(range(8)), None, 10)[3] \
        == list(range(8))
    # the user's own JAX_LOCAL_DEVICE_IDS is left to JAX (which reads it), and checked
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")
    distributed.initialize(coordinator="gpu001:8476", num_processes=4, process_id=0)
    assert captured["local_device_ids"] is None and (captured["expected"], captured["why"]) == \
        (2, "JAX_LOCAL_DEVICE_IDS=0,1")


def test_a_process_that_sees_other_devices_than_its_launch_gives_it_is_refused():
    distributed.check_devices(jax.local_device_count(), "SLURM: …")  # as many as it was given
    distributed.check_devices(None, "")  # nothing to compare with
    with pytest.raises(ConfigError, match=r"^process 0 of 1 sees 8 cpu device\(s\), but its launch \(SLURM: task 0 "
                                          r"of 1 on this node, SLURM_GPUS_ON_NODE=2\) gives it 2; is jax installed "
                                          r"for the GPU \(pip install -e '\.\[cuda\]'\)\?$"):
        distributed.check_devices(2, "SLURM: task 0 of 1 on this node, SLURM_GPUS_ON_NODE=2")


def test_a_multi_process_mesh_that_leaves_devices_out_is_refused(monkeypatch):
    """(As a launch of several processes sees it: the 8 devices here stand for all of theirs.)"""
    monkeypatch.setattr(distributed, "is_multi_process", lambda: True)
    distributed.check_mesh(sharding.make_mesh(MeshConfig(data=-1, fsdp=2)))  # all 8
    with pytest.raises(ConfigError, match=r"^the mesh \(data 2 × fsdp 2\) spans 4 of the 8 devices of this "
                                          r"launch \(1 processes × 8\); set one mesh axis to -1, or sizes whose "
                                          r"product is 8$"):
        distributed.check_mesh(sharding.make_mesh(MeshConfig(data=2, fsdp=2)))
    monkeypatch.setattr(distributed, "is_multi_process", lambda: False)
    distributed.check_mesh(sharding.make_mesh(MeshConfig(data=2, fsdp=2)))  # one process may use fewer

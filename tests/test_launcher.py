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


def srun_task(local_id: int, *, tasks: int, step_gpus: int, bound: str | None = None, **more) -> dict[str, str]:
    """A task on node 0 of a 2-node step as srun starts it: its tasks-per-node count, the step's GPUs on the node
    (SLURM_GPUS_ON_NODE), and CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS: the task's binding (`bound`, e.g. "4,5,6,7")
    when SLURM bound it to some GPUs, else all the step's (gres_common.c, srun.1; see diffjax/launcher.py)."""
    gpus = bound or ",".join(map(str, range(step_gpus)))
    return slurm(local_id, tasks=f"{tasks}(x2)", SLURM_NTASKS=str(2 * tasks), SLURM_GPUS_ON_NODE=str(step_gpus),
                 CUDA_VISIBLE_DEVICES=gpus, SLURM_STEP_GPUS=gpus, SLURMD_NODENAME="gpu001") | more


# each task's local device ids (for jax.distributed.initialize) and the GPUs they are (by the names SLURM gives
# them), for every task of a node, in each way srun binds GPUs to tasks
@pytest.mark.parametrize("tasks,ids,driven", [
    ([srun_task(0, tasks=1, step_gpus=8)], [list(range(8))], [list("01234567")]),  # --ntasks-per-node=1
    ([srun_task(i, tasks=8, step_gpus=8) for i in range(8)], [[i] for i in range(8)],
     [[str(i)] for i in range(8)]),  # a task per GPU, unbound: its local rank's
    ([srun_task(i, tasks=8, step_gpus=8, bound=str(i), SLURM_GPUS_PER_TASK="1") for i in range(8)], [[0]] * 8,
     [[str(i)] for i in range(8)]),  # --gpus-per-task=1: each sees its own
    ([srun_task(i, tasks=2, step_gpus=8, bound=g, SLURM_GPUS_PER_TASK="4") for i, g in
      enumerate(["0,1,2,3", "4,5,6,7"])], [[0, 1, 2, 3]] * 2, [list("0123"), list("4567")]),  # --gpus-per-task=4
    ([srun_task(i, tasks=2, step_gpus=8, bound=g, SLURM_GPU_BIND="closest") for i, g in
      enumerate(["0,1,2,3", "4,5,6,7"])], [[0, 1, 2, 3]] * 2, [list("0123"), list("4567")]),  # closest, 2 sockets
    ([srun_task(i, tasks=2, step_gpus=4) for i in range(2)], [[0, 1], [2, 3]], [list("01"), list("23")]),
], ids=["task-per-node", "task-per-gpu", "gpus-per-task-1", "gpus-per-task-4", "closest-per-socket", "halves"])
def test_every_gpu_of_the_step_is_driven_by_exactly_one_task(tasks, ids, driven):
    launches = [launcher.detect(env) for env in tasks]
    assert [launch.device_ids() for launch in launches] == ids
    assert [launch.owned() for launch in launches] == driven
    launcher.check_placement([[launch.node, launch.owned(), launch.step_gpus] for launch in launches])


def test_a_binding_that_shares_or_idles_gpus_is_refused_in_one_line():
    # --gpu-bind=closest × 8 tasks on 2 NUMA domains: each task sees its domain's 4 GPUs, 4 tasks on each
    closest = srun_task(3, tasks=8, step_gpus=8, bound="0,1,2,3", SLURM_GPU_BIND="closest")
    with pytest.raises(ConfigError, match=r"^SLURM: task 3 of 8 on this node, CUDA_VISIBLE_DEVICES=0,1,2,3: SLURM "
                                          r"bound this task to 4 of the step's 8 GPUs on this node, so the node's 8 "
                                          r"tasks would share its 8 GPUs; launch one task per node, one per GPU "
                                          r"\(--gpus-per-task=1\), or --gpus-per-task=GPUS/TASKS, without "
                                          r"--gpu-bind=closest$"):
        launcher.detect(closest).device_ids()
    # --gpus-per-node=8 with 2 tasks of --gpus-per-task=2: the step holds 8, its tasks 4
    with pytest.raises(ConfigError, match=r"so the node's 2 tasks would leave 4 of its 8 GPUs idle; "):
        launcher.detect(srun_task(1, tasks=2, step_gpus=8, bound="2,3", SLURM_GPUS_PER_TASK="2")).device_ids()
    # 8 tasks seeing the step's 4 GPUs, unbound
    with pytest.raises(ConfigError, match=r"4 GPUs do not split evenly between 8 tasks"):
        launcher.detect(srun_task(5, tasks=8, step_gpus=4)).device_ids()
    # what one task cannot see, all of them together do: closest with both tasks on socket 0's cores
    rows = [["gpu001", list("0123"), 8], ["gpu001", list("0123"), 8], ["gpu002", list("0123"), 8],
            ["gpu002", list("4567"), 8]]
    with pytest.raises(ConfigError, match=r"^GPU 0 of gpu001 would be driven by processes 0, 1: SLURM gave their "
                                          r"tasks the same GPUs \(--gpu-bind=closest\?\); launch one task per node "
                                          r"or --gpus-per-task=1$"):
        launcher.check_placement(rows)
    with pytest.raises(ConfigError, match=r"^gpu002: the job step holds 8 GPUs there, but its processes drive 4 "
                                          r"\(0, 1, 2, 3\); 4 would sit idle$"):
        launcher.check_placement([None, ["gpu002", list("0123"), 8]])
    launcher.check_placement(rows[2:] + [None, ["gpu003", None, None]])  # no GPUs named: nothing to check


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
    monkeypatch.setattr(distributed, "check_devices",
                        lambda expected, why, placement=None: seen.update(expected=expected, why=why,
                                                                          placement=placement))
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
    assert captured["placement"][1:] == [list("01234567"), 8]  # what the processes compare (check_placement)
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
    with pytest.raises(ConfigError, match=r"^gpu001: the job step holds 8 GPUs there, but its processes drive 4 "):
        distributed.check_devices(jax.local_device_count(), "SLURM: …", ["gpu001", list("0123"), 8])  # placement
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

"""What one training trains, N ≥ 1 members (`Members`), and how they sit on the devices (`Stack`): a run is one
member; a sweep chunk stacks members of one structure on a leading axis and steps them as one compiled program,
"vmap" or "serial" (docs/design.md §7, "Execution")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import distributed, sharding
from diffjax.config import Config, ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.model import lambda_inits
from diffjax.train.optim import STATE_NAMES, has_hyperparam, make_optimizer, set_hyperparams
from diffjax.train.state import make_init, state_shardings
from diffjax.train.step import eval_step, train_step
from diffjax.train.telemetry import attention_stats


@dataclasses.dataclass(frozen=True)
class Members:
    configs: tuple[Config, ...]  # one structure (`sweep.spec.structure_key`); traced numbers may differ
    dirs: tuple[Path, ...]  # each member's run directory: config.json, metrics.jsonl, tensorboard/
    state_dir: Path  # whose checkpoints/ hold the state: a run's own directory, a sweep chunk's state directory
    execution: str = "auto"  # how several members step: "vmap" | "serial" | "auto" (`resolve`)
    devices: int = 1  # the size of the `sweep` mesh axis the stacked members are split over

    @classmethod
    def run(cls, cfg: Config, workdir: Path) -> Members:
        return cls((cfg,), (workdir,), workdir)

    @property
    def own_directory(self) -> bool:
        """A run: one member whose checkpoints are in its own run directory, in a run's layout (no member axis)."""
        return self.dirs == (self.state_dir,)


def resolve(execution: str, mesh) -> str:
    """`auto` by platform: `serial` on a CPU (batching gains nothing there), else `vmap`, and `vmap` whenever the
    members are sharded over the `sweep` mesh axis (docs/design.md §7, "Execution")."""
    if execution != "auto":
        return execution
    return "serial" if sharding.mesh_platform(mesh) == "cpu" and mesh.shape["sweep"] == 1 else "vmap"


def over_members(fn: Callable, in_axes: Sequence[int | None], execution: str) -> Callable:
    """`fn` over the leading member axis of the arguments whose `in_axes` entry is 0 (None: shared by all
    members); outputs stacked on a leading member axis. "one": a single member, its axis dropped and put back (the
    program of `fn` itself, whatever the execution)."""
    if any(axis not in (0, None) for axis in in_axes):
        raise ValueError(f"over_members: in_axes must be 0 or None, got {in_axes}")
    if execution == "vmap":
        return jax.vmap(fn, in_axes=tuple(in_axes), spmd_axis_name="sweep")

    def members(args):
        return tuple(a for a, axis in zip(args, in_axes, strict=True) if axis == 0)

    def call(args, member):
        member = iter(member)
        return fn(*(next(member) if axis == 0 else a for a, axis in zip(args, in_axes, strict=True)))

    if execution == "one":
        return lambda *args: jax.tree.map(lambda x: x[None], call(args, jax.tree.map(lambda x: x[0], members(args))))
    return lambda *args: jax.lax.map(functools.partial(call, args), members(args))


def check_batch(cfg: Config, mesh) -> None:
    b, shards, accum = cfg.data.batch_size, sharding.batch_divisor(mesh), cfg.optim.grad_accum
    if b % (shards * accum):
        raise ConfigError(f"data.batch_size: {b} must be divisible by data×fsdp devices ({shards}) × "
                          f"optim.grad_accum ({accum})")


def diverges(nonfinite_run, cfg: Config):
    """The divergence rule: `optim.max_nonfinite` non-finite steps in a row. The member is frozen there and marked
    diverged (`Stack.train_fn`); training stops once every member has (`train.loop`)."""
    return nonfinite_run >= cfg.optim.max_nonfinite


class Stack:
    """The members' state, programs and batches on `mesh`, stacked on a leading member axis: the state is {"train":
    stacked TrainState, "diverged": [N] bool}, a member frozen from the step it diverges (`diverges`). A run is a
    stack of one: the same programs, the member axis dropped inside them ("one"), and taken off only where its files
    are written (`saved`)."""

    def __init__(self, members: Members, mesh, tx, abstract, shardings):
        """`abstract`, `shardings`: one member's TrainState on `mesh` (`state_shardings`)."""
        self.configs, self.mesh, self.tx = members.configs, mesh, tx
        self.cfg, self.n = members.configs[0], len(members.configs)
        self.own_directory = members.own_directory
        self.execution = "one" if self.n == 1 else resolve(members.execution, mesh)
        self.label = "" if self.n == 1 else f" ({self.n}× {self.execution})"  # after the progress bar's label
        self.where = "" if self.own_directory else f" of {members.state_dir.name}"  # in the stop message
        self.shared_data = all(c.data == self.cfg.data for c in self.configs)
        columns = mesh.devices.reshape(mesh.shape["sweep"], -1).T  # the devices along `sweep`
        if not self.shared_data and any(len({d.process_index for d in c}) > 1 for c in columns):
            raise ConfigError("sweep.vary_data with the members split over several processes (sweep.devices > 1) is "
                              "not supported: each process would need the batches of members it does not hold; "
                              "split the members within each process, or use the data axis across processes")
        self.member_abstract, self.member_shardings = abstract, shardings
        member = NamedSharding(mesh, P("sweep"))  # the `sweep` axis divides every chunk (`Sweep.check`)
        self.shardings = {"train": jax.tree.map(lambda s: NamedSharding(mesh, P("sweep", *s.spec)), shardings),
                          "diverged": member}
        shapes = {"train": abstract, "diverged": jax.ShapeDtypeStruct((), jnp.bool_)}
        self.abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct((self.n, *a.shape), a.dtype, sharding=s),
                                     shapes, self.shardings)
        # one member's λ_init is its config's, a constant of the program; several members' are traced numbers
        self.lambda_init = None if self.n == 1 else jax.device_put(
            jnp.stack([lambda_inits(c.model) for c in self.configs]), member)
        self.batch_sharding = NamedSharding(mesh, P("sweep", sharding.BATCH) if not self.shared_data
                                            else P(sharding.BATCH))

    @classmethod
    def build(cls, members: Members) -> Stack:
        """On the mesh of the members' config (with `devices` along `sweep`): the optimizer and state shardings."""
        cfg = members.configs[0]
        mesh = sharding.make_mesh(cfg.mesh, sweep=members.devices)
        distributed.check_mesh(mesh)
        check_batch(cfg, mesh)
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        return cls(members, mesh, tx, *state_shardings(cfg, mesh, tx))

    def over(self, fn: Callable, in_axes: Sequence[int | None]) -> Callable:
        return over_members(fn, in_axes, self.execution)

    def per_member(self, get: Callable[[Config], float], dtype) -> jax.Array:
        return jnp.asarray([get(c) for c in self.configs], dtype)

    def init(self):
        """A fresh state: each member's seed, init std (normal(std) = std · normal(1), traced) and optimizer
        numbers, every array created in its shards."""
        # jitted outside the mesh context, where the model's dummy forward would split its 8 tokens (mesh.context)
        init = jax.jit(self.over(self.init_one, (0, 0, 0)), out_shardings=self.shardings["train"])
        train = init(self.per_member(lambda c: c.train.seed, jnp.uint32),
                     self.per_member(lambda c: c.model.init_std, jnp.float32), self.optim_numbers())
        return {"train": train, "diverged": jax.device_put(jnp.zeros((self.n,), bool), self.shardings["diverged"])}

    def init_one(self, seed, std, numbers):
        cfg = self.cfg
        state = make_init(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_std=std)), self.tx)(seed)
        return state.replace(opt_state=set_hyperparams(state.opt_state, numbers))

    def optim_numbers(self) -> dict:
        """The optimizer numbers of the members' configs (peak / final lr, betas, eps, weight decay, clip), keyed by
        their names in the optimizer state, [N] each."""
        return {STATE_NAMES[f]: self.per_member(lambda c, f=f: getattr(c.optim, f), jnp.float32) for f in STATE_NAMES}

    def with_optim_numbers(self, state):
        """A restored `state` with the configs' optimizer numbers in place of the saved ones: a resume with changed
        settings (`--allow-config-change`) trains with them; unchanged, the same values. Each on its leaf's shards."""
        old = state["train"].opt_state
        numbers = {k: jax.device_put(v, optax.tree_utils.tree_get(old, k).sharding)
                   for k, v in self.optim_numbers().items() if has_hyperparam(old, k)}
        return {**state, "train": state["train"].replace(opt_state=set_hyperparams(old, numbers))}

    def train_fn(self) -> Callable:
        """(state, batch) -> (state, metrics), jitted, the incoming state donated."""
        cfg, tx = self.cfg, self.tx

        def member_step(state, batch, lambda_init, diverged):
            new, metrics = train_step(state, batch, cfg=cfg, tx=tx, lambda_init=lambda_init)
            diverged = diverged | diverges(metrics["nonfinite_run"], cfg)
            new = jax.tree.map(lambda n, o: jnp.where(diverged, o, n), new, state)  # frozen once diverged
            return new, {**metrics, "diverged": diverged}, diverged

        step = self.over(member_step, (0, None if self.shared_data else 0, 0, 0))

        def run(full, batch, lambda_init):
            train, metrics, diverged = step(full["train"], batch, lambda_init, full["diverged"])
            return {"train": train, "diverged": diverged}, metrics

        member = self.shardings["diverged"]
        fn = sharding.MeshJit(run, self.mesh, in_shardings=(self.shardings, self.batch_sharding, member),
                              out_shardings=(self.shardings, sharding.replicated(self.mesh)), donate_argnums=0)
        return WithLambdaInit(fn, self.lambda_init)

    def _over_params(self, fn: Callable) -> Callable:
        """`fn(params, batch, cfg=, lambda_init=)` over the members' params and one shared batch: (params, batch) ->
        outputs with a leading member axis."""
        def one(params, batch, lambda_init):
            return fn(params, batch, cfg=self.cfg, lambda_init=lambda_init)

        return WithLambdaInit(sharding.MeshJit(self.over(one, (0, None, 0)), self.mesh), self.lambda_init)

    def eval_fn(self) -> Callable:
        return self._over_params(eval_step)

    def stats_fn(self) -> Callable:
        return self._over_params(attention_stats)

    def params(self, state):
        return state["train"].params

    def marks(self, state) -> list[dict]:
        """What each member's evaluation records add: whether it diverged."""
        return [{"diverged": bool(d)} for d in distributed.fetch(state["diverged"])]

    def member_records(self, metrics: dict) -> list[dict]:
        """Host metrics with a leading member axis -> one dict per member (values without it are shared)."""
        metrics = {k: np.asarray(v) for k, v in metrics.items()}
        return [{k: (v[i] if v.ndim and v.shape[0] == self.n else v) for k, v in metrics.items()}
                for i in range(self.n)]

    def put_batch(self, batches: list[dict]) -> dict:
        """One batch per data iterator (one, unless the members read different data) -> the step's batch."""
        if len(batches) == 1:
            return sharding.put_batch(batches[0], self.mesh)
        stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        return sharding.put_batch(stacked, self.mesh, self.batch_sharding)

    def iterators(self) -> list:
        """The train data: one iterator, or one per member when their data configs differ; this process's rows."""
        index, count = sharding.process_share(self.mesh)
        return [make_iterator(d, split="train", process_index=index, process_count=count)
                for d in ([self.cfg.data] if self.shared_data else [c.data for c in self.configs])]

    def member_states(self, state) -> list:
        """Each member's TrainState on a run's shardings (what its run directory keeps)."""
        # One compiled program takes member i out of the stacked state: eager indexing (an op per leaf on the
        # device-stacked arrays) aborted the process in XLA:CPU in about half the runs on a busy 8-device host.
        take = jax.jit(lambda tree, i: jax.tree.map(lambda x: x[i], tree))
        shardings = self.member_shardings if self.mesh.shape["sweep"] == 1 else \
            state_shardings(self.cfg, sharding.make_mesh(self.cfg.mesh), self.tx)[1]  # a run's mesh
        return [jax.device_put(take(state["train"], np.int32(i)), shardings) for i in range(self.n)]

    def saved(self, state, data_states: list[dict]) -> tuple:
        """(state, data) as the checkpoint holds them: a run's own TrainState and its iterator's state (a run
        directory's layout), else the stacked state and {"iterators": [each iterator's]}."""
        if self.own_directory:
            return self.member_states(state)[0], data_states[0]
        return state, {"iterators": data_states}

    def restore_or_init(self, ckpt) -> tuple:
        """(step, state, [each iterator's saved state] or None) from `ckpt`'s newest readable checkpoint (`saved`'s
        layout), else a fresh state at step 0."""
        if not self.own_directory:
            step, state, data = ckpt.restore_or_init(self.abstract, self.init)
            return step, state, data and data["iterators"]
        step, train, data = ckpt.restore_or_init(self.member_abstract, lambda: None)
        if train is None:
            return 0, self.init(), None
        stack = jax.jit(lambda tree: jax.tree.map(lambda x: x[None], tree), out_shardings=self.shardings["train"])
        diverged = jax.device_put(jnp.zeros((1,), bool), self.shardings["diverged"])
        return step, {"train": stack(train), "diverged": diverged}, None if data is None else [data]  # an import: None


class WithLambdaInit:
    """A jitted function of (..., λ_init) with the members' λ_init bound (one member's: None, the config's), callable
    and lowerable with the other arguments."""

    def __init__(self, jitted: sharding.MeshJit, lambda_init):
        self.jitted, self.lambda_init = jitted, lambda_init

    def __call__(self, *args):
        return self.jitted(*args, self.lambda_init)

    def lower(self, *args):
        return self.jitted.lower(*args, self.lambda_init)

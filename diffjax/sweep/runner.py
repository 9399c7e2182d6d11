"""Running a sweep: each group of members as one compiled program over their stacked train states.

    result = run_sweep(sweep, workdir)

Per chunk of a group (the whole group unless `sweep.chunk` caps it): one init over the members (per-member seed,
init std and optimizer numbers), then one jitted step over them — the training loop's own `train_step`, vmapped
or looped member by member (`sweep.execution`, `execution.py`) — through the training loop itself
(`diffjax.train.loop.run_loop`) and its validation (and telemetry), run the same way. Numeric differences are
traced: optimizer numbers live in the optimizer state, a constant λ_init enters the model as an array. Members read
the same batches unless their data configs differ (`sweep.vary_data`), then each its own.

Non-finite steps are skipped as in a single run (`train_step`); a member that reaches `optim.max_nonfinite` of
them in a row — where a single run stops with `NonFiniteError` — is frozen (its state stops changing) and
marked diverged; the others go on. The chunk checkpoints its stacked state, the divergence flags and the data
state(s) with Orbax, so a killed sweep resumes exactly; SIGTERM saves. Each member ends with a run directory of its own
(`members/<name>/`: config.json, metrics.jsonl, checkpoints/), so `diffjax eval --workdir` works on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import distributed, sharding
from diffjax.config import ConfigError
from diffjax.data.pipeline import make_iterator
from diffjax.model import lambda_inits
from diffjax.sweep.execution import over_members, resolve
from diffjax.sweep.spec import Member, Sweep
from diffjax.train import run_config, telemetry_plot, workdir_lock
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.loop import build, run_loop
from diffjax.train.metrics import MetricsWriter
from diffjax.train.optim import STATE_NAMES, set_hyperparams
from diffjax.train.state import make_init, state_shardings
from diffjax.train.step import eval_step, train_step
from diffjax.train.telemetry import Telemetry, attention_stats
from diffjax.train.validation import Validation

DONE = "done.json"  # written in a chunk's state directory when it has finished


@dataclasses.dataclass
class SweepResult:
    workdir: Path
    interrupted: str | None = None


def run_sweep(sweep: Sweep, workdir: str | Path, *, progress: bool = True) -> SweepResult:
    distributed.check_same(sweep.to_json(), "sweep")
    workdir = Path(workdir)
    with workdir_lock.hold(workdir, "diffjax sweep"):
        return _run_sweep(sweep, workdir, progress=progress)


def _run_sweep(sweep: Sweep, workdir: Path, *, progress: bool) -> SweepResult:
    sweep_json = workdir / "sweep.json"
    if sweep_json.exists() and json.loads(sweep_json.read_text())["members"] != sweep.to_json()["members"]:
        raise ConfigError(f"{sweep_json} describes other members; resume it with the same sweep or use a new --workdir")
    if distributed.is_main():
        sweep_json.write_text(json.dumps(sweep.to_json(), indent=2))
    chunks = sweep.check().chunks()
    for g, c, members in chunks:
        state_dir = workdir / "state" / f"group{g}_chunk{c}"
        if (state_dir / DONE).exists():
            continue
        label = f"group {g + 1}" + (f" chunk {c + 1}" if len(chunks) > len({x[0] for x in chunks}) else "")
        interrupted = ChunkRun(sweep, members, workdir, state_dir).train(progress=progress, label=label)
        if interrupted:
            return SweepResult(workdir, interrupted)
    return SweepResult(workdir)


class ChunkRun:
    """The members of one chunk, stacked on a leading axis and trained as one program (`execution`: "vmap" or
    "serial")."""

    def __init__(self, sweep: Sweep, members: list[Member], workdir: Path, state_dir: Path):
        self.members, self.state_dir = members, state_dir
        self.cfg = cfg = members[0].config  # the shared structure; numbers come per member
        self.n = len(members)
        parts = build(cfg, sharding.make_mesh(cfg.mesh, sweep=sweep.options.devices))  # one member's, as a run's
        self.mesh, self.tx, abstract, shardings = parts.mesh, parts.tx, parts.abstract, parts.shardings
        self.execution = resolve(sweep.options.execution, self.mesh)
        member_axis = "sweep"  # it divides every chunk (`Sweep.check`)
        self.stacked = jax.tree.map(lambda s: NamedSharding(self.mesh, P(member_axis, *s.spec)), shardings)
        self.abstract = {
            "train": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct((self.n, *a.shape), a.dtype, sharding=s),
                                  abstract, self.stacked),
            "diverged": jax.ShapeDtypeStruct((self.n,), jnp.bool_, sharding=NamedSharding(self.mesh, P(member_axis))),
        }
        self.member_sharding = NamedSharding(self.mesh, P(member_axis))
        self.lambda_init = jax.device_put(jnp.stack([lambda_inits(m.config.model) for m in members]),
                                          self.member_sharding)
        self.shared_data = all(m.config.data == cfg.data for m in members)
        columns = self.mesh.devices.reshape(self.mesh.shape["sweep"], -1).T  # the devices along `sweep`
        if not self.shared_data and any(len({d.process_index for d in c}) > 1 for c in columns):
            raise ConfigError("sweep.vary_data with the members split over several processes (sweep.devices > 1) is "
                              "not supported: each process would need the batches of members it does not hold; "
                              "split the members within each process, or use the data axis across processes")
        batch_spec = P(member_axis, sharding.BATCH) if not self.shared_data else P(sharding.BATCH)
        self.batch_sharding = NamedSharding(self.mesh, batch_spec)
        self.member_dirs = [workdir / "members" / m.name for m in members]

    # ------------------------------------------------------------------------------------------ state and data
    def _init(self):
        """One init over the members: each member's seed, init std and optimizer numbers."""
        stds = {m.config.model.init_std for m in self.members}
        init = make_init(self.cfg, self.tx)
        unit = make_init(dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, init_std=1.0)),
                         self.tx)
        double = make_init(dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, init_std=2.0)),
                           self.tx)

        def init_one(seed, std, numbers):
            if len(stds) == 1:
                state = init(seed)
            else:  # normal(std) = std · normal(1): scale exactly the leaves drawn with init_std
                state, other = unit(seed), double(seed)
                params = jax.tree.map(lambda a, b: jnp.where(jnp.any(a != b), a * std, a), state.params, other.params)
                state = state.replace(params=params, opt_state=self.tx.init(params))
            return state.replace(opt_state=set_hyperparams(state.opt_state, numbers))

        seeds = jnp.asarray([m.config.train.seed for m in self.members], jnp.uint32)
        std = jnp.asarray([m.config.model.init_std for m in self.members], jnp.float32)
        numbers = {STATE_NAMES[f]: jnp.asarray([getattr(m.config.optim, f) for m in self.members], jnp.float32)
                   for f in STATE_NAMES}
        init_all = sharding.MeshJit(over_members(init_one, (0, 0, 0), self.execution), self.mesh,
                                    out_shardings=self.stacked)
        train = init_all(seeds, std, numbers)
        diverged = jax.device_put(jnp.zeros((self.n,), bool), self.member_sharding)
        return {"train": train, "diverged": diverged}

    def _iterators(self):
        configs = [self.cfg.data] if self.shared_data else [m.config.data for m in self.members]
        index, count = sharding.process_share(self.mesh)
        return [make_iterator(c, split="train", process_index=index, process_count=count) for c in configs]

    def _batch(self, iterators):
        batches = [it.next() for it in iterators]
        if self.shared_data:
            return sharding.put_batch(batches[0], self.mesh)
        stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        return sharding.put_batch(stacked, self.mesh, self.batch_sharding)

    # ------------------------------------------------------------------------------------------------- steps
    def _train_fn(self):
        cfg, tx = self.cfg, self.tx

        def member_step(state, batch, lambda_init, diverged):
            new, metrics = train_step(state, batch, cfg=cfg, tx=tx, lambda_init=lambda_init)
            diverged = diverged | (metrics["nonfinite_run"] >= cfg.optim.max_nonfinite)  # the run's own rule
            new = jax.tree.map(lambda n, o: jnp.where(diverged, o, n), new, state)  # frozen once diverged
            return new, {**metrics, "diverged": diverged}, diverged

        batch_axis = None if self.shared_data else 0
        step = over_members(member_step, (0, batch_axis, 0, 0), self.execution)

        def run(full, batch, lambda_init):
            train, metrics, diverged = step(full["train"], batch, lambda_init, full["diverged"])
            return {"train": train, "diverged": diverged}, metrics

        full = {"train": self.stacked, "diverged": self.member_sharding}
        rep = sharding.replicated(self.mesh)
        return sharding.MeshJit(run, self.mesh, in_shardings=(full, self.batch_sharding, self.member_sharding),
                                out_shardings=(full, rep), donate_argnums=0)

    def _validation(self) -> Validation:
        """The run's validation (batches read once), through one eval step over the members' params."""
        fn = over_members(lambda params, batch, lam: eval_step(params, batch, cfg=self.cfg, lambda_init=lam),
                          (0, None, 0), self.execution)
        fn = sharding.MeshJit(fn, self.mesh)
        return Validation(self.cfg, self.mesh, eval_fn=lambda params, batch: fn(params, batch, self.lambda_init))

    def _telemetry(self) -> Telemetry:
        """The run's telemetry probe, through one `attention_stats` over the members' params."""
        fn = over_members(lambda params, probe, lam: attention_stats(params, probe, cfg=self.cfg, lambda_init=lam),
                          (0, None, 0), self.execution)
        fn = sharding.MeshJit(fn, self.mesh)
        return Telemetry(self.cfg, self.mesh, stats_fn=lambda params, probe: fn(params, probe, self.lambda_init))

    # -------------------------------------------------------------------------------------------------- loop
    def train(self, *, progress: bool, label: str) -> str | None:
        """Train the chunk to the end (or to a stop signal: returns its description) through the training loop."""
        cfg = self.cfg
        for member, directory in zip(self.members, self.member_dirs, strict=True):
            run_config.check_resume(directory, member.config)
            directory.mkdir(parents=True, exist_ok=True)
            run_config.write(directory, member.config)
        ckpt = Checkpointer(self.state_dir / "checkpoints", cfg.train.keep_checkpoints)
        iterators = self._iterators()
        start, full, data_states = ckpt.restore_or_init(self.abstract, self._init)
        if data_states is not None:
            for it, s in zip(iterators, data_states["iterators"], strict=True):
                it.set_state(s)
        train_fn, validation = self._train_fn(), self._validation()
        writer = MemberWriters(self.member_dirs, enabled=distributed.is_main())

        def save(step, full):
            ckpt.save(step, full, {"iterators": [it.get_state() for it in iterators]})

        def evaluate(step, full) -> None:
            diverged = distributed.fetch(full["diverged"])
            for i, record in enumerate(validation.records(full["train"].params)):
                writer.writers[i].write(step, {**record, "diverged": bool(diverged[i])}, split="val")

        telemetry = None
        if cfg.train.telemetry_every:
            probe = self._telemetry()

            def telemetry(step, full) -> None:
                for i, record in enumerate(probe.records(full["train"].params)):
                    writer.writers[i].write(step, record, split=probe.name)

        with contextlib.ExitStack() as closing:
            for it in iterators:
                closing.callback(it.close)
            outcome = run_loop(cfg, full, start, step=lambda full: train_fn(full, self._batch(iterators),
                                                                            self.lambda_init),
                               save=save, evaluate=evaluate, telemetry=telemetry, writer=writer, checkpointer=ckpt,
                               progress=progress, models=self.n,
                               label=f"{label} ({self.n}× {self.execution})")
        if outcome.stopped_by:
            return f"{outcome.stopped_by} at step {outcome.step} of {self.state_dir.name}; checkpoint saved, " \
                   "rerun to resume"
        self._save_members(outcome.state)
        if distributed.is_main():
            for directory in self.member_dirs:
                telemetry_plot.write(directory)
            done = {"step": outcome.step, "members": [m.name for m in self.members]}
            (self.state_dir / DONE).write_text(json.dumps(done))
        return None

    def _save_members(self, full) -> None:
        """Each member's final state into its own run directory (`diffjax eval --workdir members/<name>`)."""
        _, shardings = state_shardings(self.cfg, sharding.make_mesh(self.cfg.mesh), self.tx)
        train = full["train"]
        # One compiled program takes member i out of the stacked state: eager indexing (an op per leaf on the
        # device-stacked arrays) aborted the process in XLA:CPU in about half the runs on a busy 8-device host.
        take = jax.jit(lambda tree, i: jax.tree.map(lambda x: x[i], tree))
        members = [jax.device_put(take(train, np.int32(i)), shardings) for i in range(len(self.member_dirs))]
        checkpointers = []
        for directory, member in zip(self.member_dirs, members, strict=True):
            checkpointers.append(Checkpointer(directory / "checkpoints", 1))
            checkpointers[-1].save(int(member.step), member, {})  # asynchronous: the writes overlap,
            if distributed.is_multi_process():  # except across processes, where concurrent saves' barriers collide
                checkpointers.pop().close()
        for ckpt in checkpointers:
            ckpt.close()


class MemberWriters:
    """Splits stacked [members, ...] metrics into one record per member, each in its own metrics.jsonl; returns
    a summary (mean over members that have not diverged) for the progress bar."""

    def __init__(self, directories: list[Path], enabled: bool):
        self.writers = [MetricsWriter(d, enabled=enabled) for d in directories]

    def write(self, step: int, metrics: dict, split: str = "train") -> dict:
        metrics = {k: np.asarray(v) for k, v in metrics.items()}
        n = len(self.writers)
        for i, writer in enumerate(self.writers):
            writer.write(step, {k: (v[i] if v.ndim and v.shape[0] == n else v) for k, v in metrics.items()}, split)
        ok = ~metrics["diverged"].astype(bool)
        summary = {k: float(np.mean(metrics[k][ok])) if ok.any() else float("nan") for k in ("loss", "lr")}
        return summary | {"tokens_per_s": float(metrics["tokens_per_s"])}

    def close(self) -> None:
        for w in self.writers:
            w.close()

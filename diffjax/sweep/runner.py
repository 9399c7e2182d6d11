"""Running a sweep: each group of members as one vmapped program over their stacked train states.

    result = run_sweep(sweep, workdir)

Per chunk of a group (the whole group unless `sweep.chunk` caps it): one vmapped init (per-member seed, init std
and optimizer numbers), then `jax.jit(jax.vmap(train_step, spmd_axis_name="sweep"))` — the training loop's own
step — with the loop's pieces (`MetricsLog`, `Periodic`, `StopRequest`, `Checkpointer`) around it. Numeric
differences are traced: optimizer numbers live in the optimizer state, a constant λ_init enters the model as an
array. Members read the same batches unless their data configs differ (`sweep.vary_data`), then each its own.

A member whose loss or gradient goes non-finite is frozen (its state stops changing) and marked diverged; the
others go on. The chunk checkpoints its stacked state, the divergence flags and the data state(s) with Orbax, so
a killed sweep resumes exactly; SIGTERM saves. Each member ends with a run directory of its own
(`members/<name>/`: config.json, metrics.jsonl, checkpoints/), so `diffjax eval --workdir` works on it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
from diffjax.sweep.spec import Member, Sweep
from diffjax.train import run_config
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.loop import MetricsLog, Periodic, ProgressBar, StopRequest, check_batch
from diffjax.train.metrics import MetricsWriter, perplexity
from diffjax.train.optim import STATE_NAMES, make_optimizer, set_hyperparams
from diffjax.train.state import make_init, state_shardings
from diffjax.train.step import eval_step, train_step

log = logging.getLogger("diffjax")
DONE = "done.json"  # written in a chunk's state directory when it has finished


@dataclasses.dataclass
class SweepResult:
    workdir: Path
    interrupted: str | None = None


def run_sweep(sweep: Sweep, workdir: str | Path, *, progress: bool = True) -> SweepResult:
    distributed.check_same(sweep.to_json(), "sweep")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sweep_json = workdir / "sweep.json"
    if sweep_json.exists() and json.loads(sweep_json.read_text())["members"] != sweep.to_json()["members"]:
        raise ValueError(f"{sweep_json} describes other members; resume it with the same sweep or use a new --workdir")
    if distributed.is_main():
        sweep_json.write_text(json.dumps(sweep.to_json(), indent=2))
    chunks = [(g, c, chunk) for g, group in enumerate(sweep.groups())
              for c, chunk in enumerate(_chunks(group, sweep.options.chunk))]
    for g, c, members in chunks:
        state_dir = workdir / "state" / f"group{g}_chunk{c}"
        if (state_dir / DONE).exists():
            continue
        label = f"group {g + 1}" + (f" chunk {c + 1}" if len(chunks) > len({x[0] for x in chunks}) else "")
        interrupted = ChunkRun(sweep, members, workdir, state_dir).train(progress=progress, label=label)
        if interrupted:
            return SweepResult(workdir, interrupted)
    return SweepResult(workdir)


def _chunks(group: list[Member], size: int) -> list[list[Member]]:
    size = size or len(group)
    return [group[i:i + size] for i in range(0, len(group), size)]


class ChunkRun:
    """The members of one chunk, stacked on a leading axis and trained as one program."""

    def __init__(self, sweep: Sweep, members: list[Member], workdir: Path, state_dir: Path):
        self.members, self.state_dir = members, state_dir
        self.cfg = cfg = members[0].config  # the shared structure; numbers come per member
        self.n = len(members)
        self.mesh = sharding.make_mesh(cfg.mesh, sweep=sweep.options.devices)
        check_batch(cfg, self.mesh)
        self.tx = make_optimizer(cfg.optim, cfg.train.steps)
        abstract, shardings = state_shardings(cfg, self.mesh, self.tx)
        member_axis = "sweep" if self.n % self.mesh.shape["sweep"] == 0 else None
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
        """One vmapped init: each member's seed, init std and optimizer numbers."""
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
        train = jax.jit(jax.vmap(init_one), out_shardings=self.stacked)(seeds, std, numbers)
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
            diverged = diverged | (metrics["skipped"] > 0)
            new = jax.tree.map(lambda n, o: jnp.where(diverged, o, n), new, state)  # frozen once diverged
            return new, {**metrics, "diverged": diverged}, diverged

        batch_axis = None if self.shared_data else 0
        step = jax.vmap(member_step, in_axes=(0, batch_axis, 0, 0), spmd_axis_name="sweep")

        def run(full, batch, lambda_init):
            train, metrics, diverged = step(full["train"], batch, lambda_init, full["diverged"])
            return {"train": train, "diverged": diverged}, metrics

        full = {"train": self.stacked, "diverged": self.member_sharding}
        rep = sharding.replicated(self.mesh)
        return sharding.MeshJit(run, self.mesh, in_shardings=(full, self.batch_sharding, self.member_sharding),
                                out_shardings=(full, rep), donate_argnums=0)

    def _validation(self):
        """Validation batches read once; one vmapped eval step over the members' params."""
        index, count = sharding.process_share(self.mesh)
        data = make_iterator(self.cfg.data, split="val", process_index=index, process_count=count)
        batches = [sharding.put_batch(data.next(), self.mesh) for _ in range(self.cfg.train.eval_batches)]
        data.close()
        fn = jax.vmap(lambda params, batch, lam: eval_step(params, batch, cfg=self.cfg, lambda_init=lam),
                      in_axes=(0, None, 0), spmd_axis_name="sweep")
        fn = sharding.MeshJit(fn, self.mesh)

        def evaluate(params) -> list[dict]:
            totals = None
            for batch in batches:
                out = distributed.fetch(fn(params, batch, self.lambda_init))
                totals = out if totals is None else {k: totals[k] + out[k] for k in out}
            records = []
            for i in range(self.n):
                tokens = max(float(totals["tokens"][i]), 1.0)
                loss = float(totals["loss_sum"][i]) / tokens
                records.append({"loss": loss, "perplexity": perplexity(loss),
                                "token_accuracy": float(totals["correct"][i]) / tokens,
                                "exact_match": float(totals["exact_rows"][i]) / max(float(totals["rows"][i]), 1.0)})
            return records

        return evaluate

    # -------------------------------------------------------------------------------------------------- loop
    def train(self, *, progress: bool, label: str) -> str | None:
        """Train the chunk to the end (or to a stop signal: returns its description)."""
        cfg = self.cfg
        for member, directory in zip(self.members, self.member_dirs, strict=True):
            run_config.check_resume(directory, member.config)
            directory.mkdir(parents=True, exist_ok=True)
            run_config.write(directory, member.config)
        ckpt = Checkpointer(self.state_dir / "checkpoints", cfg.train.keep_checkpoints)
        iterators = self._iterators()
        restored = ckpt.restore_latest(self.abstract)
        if restored:
            start, full, data_states = restored
            for it, s in zip(iterators, data_states["iterators"], strict=True):
                it.set_state(s)
            log.info("sweep: resumed %s from step %d", self.state_dir.name, start)
        else:
            start, full = 0, self._init()
        train_fn, evaluate = self._train_fn(), self._validation()
        is_main = distributed.is_main()
        writer = MemberWriters(self.member_dirs, enabled=is_main)

        def save(step, full):
            ckpt.save(step, full, {"iterators": [it.get_state() for it in iterators]})

        def validate(step, full):
            diverged = distributed.fetch(full["diverged"])
            for i, record in enumerate(evaluate(full["train"].params)):
                writer.writers[i].write(step, {**record, "diverged": bool(diverged[i])}, split="val")

        hooks = [Periodic(cfg.train.checkpoint_every, save), Periodic(cfg.train.eval_every, validate)]
        stop, step = StopRequest(), start
        try:
            with stop.installed(), ProgressBar(cfg.train.steps, start, enabled=progress and is_main,
                                               label=f"sweep {label}: {self.n} members", scale=self.n) as bar:
                metrics_log = MetricsLog(writer, bar, cfg=cfg, start_step=start, n_devices=jax.device_count(),
                                         models=self.n)
                for step in range(start, cfg.train.steps):
                    if stop.signal:
                        break
                    full, metrics = train_fn(full, self._batch(iterators), self.lambda_init)
                    metrics_log.push(step, metrics)
                    due = [hook for hook in hooks if hook.due(step + 1, cfg.train.steps)]
                    if due:
                        jax.block_until_ready(full)
                        with metrics_log.pause():
                            for hook in due:
                                hook.fn(step + 1, full)
                else:
                    step = cfg.train.steps
                metrics_log.flush()
                if stop.signal:
                    if ckpt.manager.latest_step() != step:
                        save(step, full)
                    return f"{stop.signal} at step {step} of {self.state_dir.name}; checkpoint saved, rerun to resume"
            ckpt.wait()  # one Orbax save at a time: across processes, concurrent saves' barriers collide
            self._save_members(full)
            if is_main:
                done = {"step": step, "members": [m.name for m in self.members]}
                (self.state_dir / DONE).write_text(json.dumps(done))
        except BaseException:
            ckpt.abandon()
            raise
        finally:
            ckpt.close()
            writer.close()
            for it in iterators:
                it.close()
        return None

    def _save_members(self, full) -> None:
        """Each member's final state into its own run directory (`diffjax eval --workdir members/<name>`)."""
        _, shardings = state_shardings(self.cfg, sharding.make_mesh(self.cfg.mesh), self.tx)
        train = full["train"]
        checkpointers = []
        for i, directory in enumerate(self.member_dirs):
            member = jax.device_put(jax.tree.map(lambda x, i=i: x[i], train), shardings)
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

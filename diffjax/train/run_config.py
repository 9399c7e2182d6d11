"""A run directory's `config.json`: the resolved config, its segments after an allowed change, and on resume the
refusal of a change to the trajectory (docs/training.md, "Resume"; docs/design.md §3, "Resuming")."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax

from diffjax import config as config_lib
from diffjax import distributed, paths
from diffjax.config import AT_STEP_0, Config, ConfigError, DataConfig, ModelConfig, OptimConfig
from diffjax.data import tokenizer
from diffjax.train.optim import make_optimizer
from diffjax.train.state import make_init

log = logging.getLogger("diffjax")

# What a run directory holds (config.json, metrics.jsonl, checkpoints/: docs/training.md, "The run directory"), in
# config.json; a change that today's runs would not read back bumps it (tests/fixtures/run_v1 is format 1).
RUN_FORMAT = 1

# The data fields that define the stream of batches a saved data position points into.
DATA_STREAM = tuple(f.name for f in dataclasses.fields(DataConfig)
                    if f"data.{f.name}" not in config_lib.fields_where("free"))


def _flat(cfg: Config) -> dict[str, object]:
    return {"name": cfg.name} | {f"{section.name}.{k}": v for section in dataclasses.fields(Config)
                                 if section.name != "name"
                                 for k, v in dataclasses.asdict(getattr(cfg, section.name)).items()}


def changed_fields(old: Config, new: Config) -> list[str]:
    """'section.field: <old> in the run, <new> now' for every trajectory-changing (not `free`) field that differs."""
    before, after, free = _flat(old), _flat(new), config_lib.fields_where("free")
    return [f"{key}: {before[key]!r} in the run, {after[key]!r} now" for key in before
            if before[key] != after[key] and key not in free]


def read(workdir: Path) -> dict | None:
    """config.json's config (and segments), once its run format is one this code reads (format 1: no field)."""
    path = paths.run_dir(workdir) / "config.json"
    paths.refresh(path)
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if (found := stored.pop("run_format", 1)) != RUN_FORMAT:  # a bump migrates the format before it here, or refuses
        raise ConfigError(f"{path}: run format {found}; this diffjax reads format {RUN_FORMAT}"
                          + (" (a newer diffjax wrote the run: update diffjax)" if found > RUN_FORMAT else ""))
    return stored


def load(workdir: Path, overrides=()) -> Config:
    """The config a run directory holds (its config.json: the segment in force), with `a.b=c` overrides."""
    stored = read(workdir)
    if stored is None:
        raise ConfigError(f"{workdir} is not a run directory: it has no config.json")
    cfg = _stored(workdir, stored)
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    return cfg.validate()


def fixed_changes(old: Config, new: Config, *, was: str = "in the run", at_step_0: bool = False) -> list[str]:
    """'section.field: <old> in the run, <new> now (why)' for each change a resume cannot make, nor an import (a run
    made `at_step_0`: AT_STEP_0 fields it sets): a `fixed` field's, by its reason, and a change of the saved state's
    structure (`_reshapes`), named alone where valid alone, else all are."""
    before, after = _flat(old), _flat(new)
    free, fixed = config_lib.fields_where("free"), config_lib.fields_where("fixed")
    changed = [k for k in before if before[k] != after[k] and k not in free]
    why = {k: fixed[k] for k in changed if k in fixed and not (at_step_0 and fixed[k] == AT_STEP_0)}
    rest = [k for k in changed if k not in fixed]
    joint = rest and _reshapes(old, functools.reduce(lambda c, k: config_lib.replace_field(c, k, after[k]), rest, old))
    for k in rest if joint else ():
        with contextlib.suppress(ConfigError):  # valid only with the other changes
            why[k] = _reshapes(old, config_lib.replace_field(old, k, after[k]).validate())
    if joint and not any(why.get(k) for k in rest):
        why |= dict.fromkeys(rest, joint)
    return [f"{k}: {before[k]!r} {was}, {after[k]!r} now ({why[k]})" for k in changed if why.get(k)]


def _reshapes(old: Config, new: Config) -> str | None:
    """Which part of the saved state `new` gives another structure (tree, shapes, dtypes) than `old` has, if any."""
    states = [_abstract_state(c.model, c.optim, c.train.steps) for c in (old, new)]
    return next((f"it shapes the saved {part}" for part, a, b in zip(("parameters", "optimizer state"), *states,
                                                                       strict=True) if a != b), None)


@functools.lru_cache(maxsize=64)
def _abstract_state(model: ModelConfig, optim: OptimConfig, steps: int) -> tuple:
    """A run's (parameters, optimizer state) as (tree, shapes and dtypes), by `jax.eval_shape`: nothing computed."""
    state = jax.eval_shape(make_init(Config(model=model, optim=optim), make_optimizer(optim, steps)), 0)
    return tuple((jax.tree.structure(p), [(a.shape, a.dtype) for a in jax.tree.leaves(p)])
                 for p in (state.params, state.opt_state))


def check_resume(workdir: Path, cfg: Config, *, allow_change: bool = False) -> None:
    """Refuse (ConfigError) to continue the run in `workdir` with a config that changes its trajectory, or, with
    `allow_change`, with one that changes what a resume cannot (`fixed_changes`)."""
    stored = read(workdir)
    if stored is None:
        return
    old, new = _stored(workdir, stored), _in_run(workdir, cfg)
    fixed = fixed_changes(old, new) if allow_change else []
    if fixed:
        raise ConfigError(f"{paths.run_dir(workdir) / 'config.json'}: a resume cannot change, even with "
                          f"--allow-config-change:\n  " + "\n  ".join(fixed) + "\nRun it with the run's own values, "
                          "or start a new --workdir")
    changes = changed_fields(old, new)
    if changes and allow_change:
        log.info("continuing %s with changed settings: %s", workdir, "; ".join(changes))
    elif changes:
        raise ConfigError(f"{paths.run_dir(workdir) / 'config.json'}: resuming this run with a different config "
                          f"would change its trajectory:\n  " + "\n  ".join(changes) + "\nRun it with the run's own "
                          "settings, use a new --workdir, or pass --allow-config-change to continue it with the new "
                          "ones (config.json then records each segment)")


def data_restart(workdir: Path, cfg: Config) -> str | None:
    """Why run `workdir`'s saved data position cannot go on under `cfg` (its data stream changed), else None."""
    stored = read(workdir)
    if stored is None:
        return None
    before, now = _stored(workdir, stored).data, _in_run(workdir, cfg).data
    changed = [f"data.{name}" for name in DATA_STREAM if getattr(before, name) != getattr(now, name)]
    return f"{', '.join(changed)} changed: the data starts from its beginning" if changed else None


def write(workdir: Path, cfg: Config, *, step: int = 0, note: str | None = None) -> None:
    """Write config.json (process 0, atomically): the config in force, and its segments when it changed at `step`
    (`note`: what the new segment did differently, e.g. a `data_restart`)."""
    cfg = _in_run(workdir, cfg)
    stored, record = read(workdir), {"run_format": RUN_FORMAT} | _recorded(cfg, workdir)
    if stored is not None:
        segments = stored.get("segments") or [{"from_step": 0, "config": {k: v for k, v in stored.items()
                                                                          if k != "segments"}}]
        if changed_fields(_stored(workdir, segments[-1]["config"]), cfg):
            segments.append({"from_step": step, "config": _recorded(cfg, workdir)}
                            | ({"data_restarted": note} if note else {}))
        if len(segments) > 1:
            record["segments"] = segments
    if distributed.is_main():  # atomically: the other processes may be reading it
        tokenizer.own_tokenizer(cfg.data.tokenizer, workdir)  # its files first, then the config.json naming them
        paths.write_text(paths.run_dir(workdir) / "config.json", json.dumps(record, indent=2))


# Paths in config.json resolve from any working directory: an HF tokenizer's files live in RUN/tokenizer/, named
# relatively (a tokenizer directory equal to the run's copy counts as the copy: diffjax.data.tokenizer); data.path is
# recorded absolute, or relative to the run where the data lies inside it; train.workdir is the run directory. So a
# run directory can be moved, and a loaded config holds absolute paths.
def _stored(workdir: Path, record: dict) -> Config:
    """A config.json record as a Config whose paths load from anywhere."""
    cfg = config_lib.from_dict(record)
    return _placed(cfg, workdir, tokenizer.stored_spec(cfg.data.tokenizer, workdir),
                   _data_path(cfg.data.path, workdir))


def _in_run(workdir: Path, cfg: Config) -> Config:
    """`cfg` (its relative paths from this working directory) as run `workdir` holds it."""
    path = cfg.data.path and str(Path(cfg.data.path).resolve())
    if paths.is_remote(workdir) and cfg.data.tokenizer not in tokenizer.TOKENIZERS:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: a run on object storage ({workdir}) takes a "
                          f"registered tokenizer ({', '.join(tokenizer.TOKENIZERS)}); an HF tokenizer directory is "
                          f"not copied there: train in a local or shared --workdir")
    return _placed(cfg, workdir, tokenizer.as_run_copy(cfg.data.tokenizer, workdir), path)


def _recorded(cfg: Config, workdir: Path) -> dict:
    """`cfg` (`_in_run`'s) as config.json records it: an HF tokenizer as the run's own copy, data inside the run
    relative to it, train.workdir where the run directory is now."""
    record, run = json.loads(cfg.to_json()), paths.resolved(workdir)
    record["data"]["tokenizer"] = tokenizer.recorded_spec(cfg.data.tokenizer)
    record["train"]["workdir"] = str(run)
    if cfg.data.path and not paths.is_remote(run) and Path(cfg.data.path).is_relative_to(run):
        record["data"]["path"] = str(Path(cfg.data.path).relative_to(run))
    return record


def _data_path(path: str | None, workdir: Path) -> str | None:
    """A recorded data.path, absolute: relative to the run directory (a config.json written before runs recorded it
    so holds the path as typed, relative to where the run was made: tried second, from here)."""
    if path is None or Path(path).is_absolute():
        return path
    if paths.is_remote(workdir):  # data is never inside a remote run (data.path is local: config.py)
        return str(Path(path).resolve())
    in_run = Path(workdir) / path
    return str((in_run if in_run.exists() or not Path(path).exists() else Path(path)).resolve())


def _placed(cfg: Config, workdir: Path, tokenizer_spec: str, data_path: str | None) -> Config:
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_spec, path=data_path)
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, workdir=str(workdir)))

"""A run directory's `config.json`: the resolved config, its segments after an allowed change, and on resume the
refusal of a change to the trajectory (docs/training.md, "Resume"; docs/design.md §3, "Resuming")."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from diffjax import config as config_lib
from diffjax import distributed
from diffjax.config import Config, ConfigError, DataConfig
from diffjax.data import tokenizer

log = logging.getLogger("diffjax")

# "section.field" (or a whole "section") that a resume may change without altering the trajectory.
FREE_TO_CHANGE = {"name", "mesh", "train.log_every", "train.eval_every", "train.eval_batches",
                  "train.checkpoint_every", "train.keep_checkpoints", "train.workdir", "data.num_workers",
                  "model.attention_impl", "model.context_strategy", "model.remat", "model.loss_chunk",
                  "model.hf_class"}


# What a resume cannot change even with --allow-config-change (refused by name): the saved state's structure, or what
# acted only at step 0. Every other field applies from the resume on (docs/training.md, "Resume", the table).
STRUCTURE = "the checkpoint's parameters have the run's structure"
FIXED = {f"model.{f}": STRUCTURE for f in ("arch", "vocab_size", "d_model", "n_layers", "n_heads", "head_dim",
                                             "n_kv_heads", "ffn_dim", "tie_embeddings", "qkv_bias", "qk_norm",
                                             "headwise_norm", "gate", "scan_layers")} | {
    "model.init_std": "it drew the initial parameters, at step 0", "train.seed": "it drew the initial parameters, at "
    "step 0"}
# 0 turns a part of the optimizer (or the model) off, and its state with it: a change between 0 and not 0 is refused.
OPTIONAL_PARTS = {"optim.clip_norm": "clipping", "optim.lambda_warmup_steps": "the λ warm-up",
                  "model.lambda_ramp_steps": "the λ ramp"}


# The data fields that define the stream of batches a saved data position points into.
DATA_STREAM = tuple(f.name for f in dataclasses.fields(DataConfig) if f"data.{f.name}" not in FREE_TO_CHANGE)


def _flat(cfg: Config) -> dict[str, object]:
    return {"name": cfg.name} | {f"{section.name}.{k}": v for section in dataclasses.fields(Config)
                                 if section.name != "name"
                                 for k, v in dataclasses.asdict(getattr(cfg, section.name)).items()}


def changed_fields(old: Config, new: Config) -> list[str]:
    """'section.field: <old> in the run, <new> now' for every trajectory-changing field that differs."""
    before, after = _flat(old), _flat(new)
    return [f"{key}: {before[key]!r} in the run, {after[key]!r} now" for key in before
            if before[key] != after[key] and key not in FREE_TO_CHANGE and key.split(".")[0] not in FREE_TO_CHANGE]


def read(workdir: Path) -> dict | None:
    path = Path(workdir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def load(workdir: Path, overrides=()) -> Config:
    """The config a run directory holds (its config.json: the segment in force), with `a.b=c` overrides."""
    stored = read(workdir)
    if stored is None:
        raise ConfigError(f"{workdir} is not a run directory: it has no config.json")
    cfg = _stored(workdir, stored)
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    return cfg.validate()


def fixed_changes(old: Config, new: Config) -> list[str]:
    """'section.field: <old> in the run, <new> now (why)' for each change a resume cannot make (`FIXED`, and
    `OPTIONAL_PARTS` turned on or off)."""
    before, after = _flat(old), _flat(new)
    why = {k: reason for k, reason in FIXED.items() if before[k] != after[k]}
    why |= {k: f"{part} is on or off in the saved {'parameters' if k.startswith('model.') else 'optimizer state'}"
            for k, part in OPTIONAL_PARTS.items()
            if (before[k] == 0) != (after[k] == 0)}
    return [f"{k}: {before[k]!r} in the run, {after[k]!r} now ({reason})" for k, reason in why.items()]


def check_resume(workdir: Path, cfg: Config, *, allow_change: bool = False) -> None:
    """Refuse (ConfigError) to continue the run in `workdir` with a config that changes its trajectory, or, with
    `allow_change`, with one that changes what a resume cannot (`fixed_changes`)."""
    stored = read(workdir)
    if stored is None:
        return
    old, new = _stored(workdir, stored), _in_run(workdir, cfg)
    fixed = fixed_changes(old, new) if allow_change else []
    if fixed:
        raise ConfigError(f"{Path(workdir) / 'config.json'}: a resume cannot change, even with "
                          f"--allow-config-change:\n  " + "\n  ".join(fixed) + "\nRun it with the run's own values, "
                          "or start a new --workdir")
    changes = changed_fields(old, new)
    if changes and allow_change:
        log.info("continuing %s with changed settings: %s", workdir, "; ".join(changes))
    elif changes:
        raise ConfigError(f"{Path(workdir) / 'config.json'}: resuming this run with a different config would change "
                          f"its trajectory:\n  " + "\n  ".join(changes) + "\nRun it with the run's own settings, "
                          "use a new --workdir, or pass --allow-config-change to continue it with the new ones "
                          "(config.json then records each segment)")


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
    stored, record = read(workdir), _recorded(cfg, workdir)
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
        path = Path(workdir) / "config.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)


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
    return _placed(cfg, workdir, tokenizer.as_run_copy(cfg.data.tokenizer, workdir), path)


def _recorded(cfg: Config, workdir: Path) -> dict:
    """`cfg` (`_in_run`'s) as config.json records it: an HF tokenizer as the run's own copy, data inside the run
    relative to it, train.workdir where the run directory is now."""
    record, run = json.loads(cfg.to_json()), Path(workdir).resolve()
    record["data"]["tokenizer"] = tokenizer.recorded_spec(cfg.data.tokenizer)
    record["train"]["workdir"] = str(run)
    if cfg.data.path and Path(cfg.data.path).is_relative_to(run):
        record["data"]["path"] = str(Path(cfg.data.path).relative_to(run))
    return record


def _data_path(path: str | None, workdir: Path) -> str | None:
    """A recorded data.path, absolute: relative to the run directory (a config.json written before runs recorded it
    so holds the path as typed, relative to where the run was made: tried second, from here)."""
    if path is None or Path(path).is_absolute():
        return path
    in_run = Path(workdir) / path
    return str((in_run if in_run.exists() or not Path(path).exists() else Path(path)).resolve())


def _placed(cfg: Config, workdir: Path, tokenizer_spec: str, data_path: str | None) -> Config:
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_spec, path=data_path)
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, workdir=str(workdir)))

"""A run directory's `config.json`: the resolved config, and on resume the check that the run goes on unchanged.

Resuming with a config that would change the run's trajectory (the model, the data, the optimizer, the step count
that shapes the learning-rate schedule, the seed) is refused with an error naming every changed field, unless the
user says so (`diffjax train --allow-config-change`). Then `config.json` keeps each segment of the run:
`"segments": [{"from_step": 0, "config": {...}}, {"from_step": 10, "config": {...}}]`, the top level being the
config in force. Settings that change only how a run is carried out (logging, evaluation and checkpoint cadence,
the mesh — a checkpoint restores onto any mesh —, the attention implementation and context-parallel strategy,
remat and loss chunking) may change freely. A change of the data stream itself (its source, path, tokenizer,
sequence length, batch, order, mixture) makes the saved data position meaningless: the data then starts from its
beginning, and the segment records why (`data_restart`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diffjax import config as config_lib
from diffjax import distributed
from diffjax.config import Config, ConfigError, DataConfig

# "section.field" (or a whole "section") that a resume may change without altering the trajectory.
FREE_TO_CHANGE = {"name", "mesh", "train.log_every", "train.eval_every", "train.eval_batches",
                  "train.checkpoint_every", "train.keep_checkpoints", "train.workdir", "data.num_workers",
                  "model.attention_impl", "model.context_strategy", "model.remat", "model.loss_chunk"}


# The data fields that define the stream of batches a saved data position points into.
DATA_STREAM = tuple(f.name for f in dataclasses.fields(DataConfig) if f"data.{f.name}" not in FREE_TO_CHANGE)


def _flat(cfg: Config) -> dict[str, object]:
    out = {"name": cfg.name}
    for section in dataclasses.fields(Config):
        if section.name != "name":
            out |= {f"{section.name}.{k}": v for k, v in dataclasses.asdict(getattr(cfg, section.name)).items()}
    return out


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
    cfg = config_lib.from_dict(stored)
    for assignment in overrides:
        cfg = config_lib.override(cfg, assignment)
    return cfg.validate()


def check_resume(workdir: Path, cfg: Config, *, allow_change: bool = False) -> None:
    """Refuse (ConfigError) to continue the run in `workdir` with a config that changes its trajectory."""
    stored = read(workdir)
    if stored is None or allow_change:
        return
    changes = changed_fields(config_lib.from_dict(stored), cfg)
    if changes:
        raise ConfigError(f"{Path(workdir) / 'config.json'}: resuming this run with a different config would change "
                          f"its trajectory:\n  " + "\n  ".join(changes) + "\nRun it with the run's own settings, "
                          "use a new --workdir, or pass --allow-config-change to continue it with the new ones "
                          "(config.json then records each segment)")


def data_restart(workdir: Path, cfg: Config) -> str | None:
    """Why run `workdir`'s saved data position cannot go on under `cfg` (its data stream changed), else None."""
    stored = read(workdir)
    if stored is None:
        return None
    before = config_lib.from_dict(stored).data
    changed = [f"data.{name}" for name in DATA_STREAM if getattr(before, name) != getattr(cfg.data, name)]
    return f"{', '.join(changed)} changed: the data starts from its beginning" if changed else None


def write(workdir: Path, cfg: Config, *, step: int = 0, note: str | None = None) -> None:
    """Write config.json (process 0, atomically): the config in force, and its segments when it changed at `step`
    (`note`: what the new segment did differently, e.g. a `data_restart`)."""
    stored = read(workdir)
    record = json.loads(cfg.to_json())
    if stored is not None:
        segments = stored.get("segments") or [{"from_step": 0, "config": {k: v for k, v in stored.items()
                                                                          if k != "segments"}}]
        if changed_fields(config_lib.from_dict(segments[-1]["config"]), cfg):
            segments.append({"from_step": step, "config": json.loads(cfg.to_json())}
                            | ({"data_restarted": note} if note else {}))
        if len(segments) > 1:
            record["segments"] = segments
    if distributed.is_main():  # atomically: the other processes may be reading it
        path = Path(workdir) / "config.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)

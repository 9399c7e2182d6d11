"""Sweep definitions: a base `Config` plus members, each a named set of `section.field` overrides, grouped by
structure into one compiled program per group (docs/sweeps.md; docs/design.md §7)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

from diffjax import checks
from diffjax import config as config_lib
from diffjax.config import Config, ConfigError

# How a group's members are stepped (`train.members.resolve`; docs/design.md §7, "Execution").
EXECUTIONS = ("auto", "vmap", "serial")

# Fields a group's members may differ in: they enter its one program as traced values (`config.setting`'s `traced`).
NUMERIC = tuple(config_lib.fields_where("traced"))


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    vary_data: bool = False  # each member its own data order (data.seed + member index) instead of shared batches
    devices: int = 1  # size of the `sweep` mesh axis that shards the stacked members
    chunk: int = 0  # at most this many members of a group at once (0: the whole group)
    reference: str = ""  # the variant the report's paired differences are taken against ("": the first)
    execution: str = "auto"  # one of EXECUTIONS
    paired_init: bool = True  # variants of one seed share every initial parameter of equal path and shape

    def validate(self) -> SweepOptions:
        if self.devices < 1:
            raise ConfigError(f"sweep.devices: must be >= 1, got {self.devices}")
        if self.chunk < 0:
            raise ConfigError(f"sweep.chunk: must be >= 0 (0: the whole group), got {self.chunk}")
        if self.execution not in EXECUTIONS:
            raise ConfigError(f"sweep.execution: unknown {self.execution!r}; choose one of {EXECUTIONS}")
        if self.execution == "serial" and self.devices > 1:
            raise ConfigError(f"sweep.execution: 'serial' steps one member at a time, but sweep.devices="
                              f"{self.devices} shards the members over devices; use 'vmap' or 'auto'")
        return self


@dataclasses.dataclass(frozen=True)
class Member:
    name: str  # unique, directory-safe: "<variant>__seed<i>"
    variant: str  # what is aggregated over seeds
    seed: int
    overrides: tuple[tuple[str, object], ...]
    config: Config


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base: Config
    members: tuple[Member, ...]
    options: SweepOptions = SweepOptions()

    @classmethod
    def build(cls, base: Config, *axes: list[tuple[str, dict]], seeds: int = 1, name: str | None = None,
              options: SweepOptions = SweepOptions()) -> Sweep:
        if seeds < 1:
            raise ConfigError(f"sweep: seeds must be >= 1, got {seeds}")
        members = []
        for combo in itertools.product(*axes):  # no axes: one empty combination
            label = ",".join(lab for lab, _ in combo) or "base"
            overrides = {k: v for _, ovr in combo for k, v in ovr.items()}
            for seed in range(seeds):
                members.append(_member(base, label, seed, overrides))
        if options.vary_data:
            members = vary_data(members)
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ConfigError(f"sweep: member names collide: {sorted(n for n in names if names.count(n) > 1)}")
        return cls(name or base.name, base, tuple(members), options).check()

    def groups(self) -> list[list[Member]]:
        """Members by structure, in first-appearance order; within a group, in sweep order."""
        by_key: dict[str, list[Member]] = {}
        for m in self.members:
            by_key.setdefault(structure_key(m.config), []).append(m)
        return list(by_key.values())

    def chunks(self) -> list[tuple[int, int, list[Member]]]:
        """(group index, chunk index, members): each group in runs of at most `options.chunk` members."""
        out = []
        for g, group in enumerate(self.groups()):
            size = self.options.chunk or len(group)
            out += [(g, c, group[i:i + size]) for c, i in enumerate(range(0, len(group), size))]
        return out

    def check(self) -> Sweep:
        """The options, alone and against the members (the `sweep` axis splits every chunk; the reference exists)."""
        self.options.validate()
        variants = list(dict.fromkeys(m.variant for m in self.members))
        if self.options.reference and self.options.reference not in variants:
            raise ConfigError(f"sweep.reference: {self.options.reference!r} is not a variant of this sweep; "
                              f"variants: {variants}")
        devices = self.options.devices
        for g, c, members in self.chunks():
            if len(members) % devices:
                sizes = sorted({len(m) for _, _, m in self.chunks()})
                where = f"group {g + 1}" + (f" chunk {c + 1}" if self.options.chunk else "")
                raise ConfigError(f"sweep.devices={devices} must divide the members trained together, but {where} "
                                  f"has {len(members)} (chunk sizes: {sizes}; sweep.chunk={self.options.chunk}); "
                                  f"choose sweep.devices dividing each, or sweep.chunk a multiple of {devices} that "
                                  f"divides every group")
        return self

    def to_json(self) -> dict:
        return {"name": self.name, "options": dataclasses.asdict(self.options),
                "members": [{"name": m.name, "variant": m.variant, "seed": m.seed,
                             "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in m.overrides}}
                            for m in self.members],
                "groups": [[m.name for m in g] for g in self.groups()]}


def product(axes: dict[str, list]) -> list[list[tuple[str, dict]]]:
    """One axis per key (use with `*`): `*product({"optim.lr": [1e-3, 3e-3], "optim.b2": [0.95, 0.98]})`."""
    return [[(f"{_short(k)}={v}", {k: v}) for v in values] for k, values in axes.items()]


def zipped(axes: dict[str, list]) -> list[tuple[str, dict]]:
    """One axis whose keys vary together: `zipped({"model.n_heads": [2, 4], "model.head_dim": [32, 16]})`."""
    if len({len(v) for v in axes.values()}) != 1:
        raise ConfigError(f"sweep: zipped axes need lists of one length, got { {k: len(v) for k, v in axes.items()} }")
    return [(",".join(f"{_short(k)}={v}" for k, v in zip(axes, values, strict=True)),
             dict(zip(axes, values, strict=True))) for values in zip(*axes.values(), strict=True)]


def variants(named: dict[str, dict]) -> list[tuple[str, dict]]:
    """One axis of named override sets (e.g. the rows of an ablation table)."""
    return list(named.items())


def structure_key(cfg: Config) -> str:
    """What must be equal for two members to share one compiled program."""
    d = cfg.to_dict()
    for key in NUMERIC:
        section, field = key.split(".")
        d[section].pop(field)
    d.pop("name")
    d["train"].pop("workdir")
    d["clipped"] = cfg.optim.clip_norm > 0
    return json.dumps(d, sort_keys=True)


def vary_data(members: list[Member]) -> list[Member]:
    """Each member its own data order: member i reads data.seed + i (unless it sets data.seed itself); the
    validation split follows data.split_seed, which all of them share."""
    return [m if "data.seed" in dict(m.overrides) else
            dataclasses.replace(m, config=config_lib.replace_field(m.config, "data.seed", m.config.data.seed + i))
            for i, m in enumerate(members)]


def unpair_init(members: list[Member]) -> list[Member]:
    """Each variant its own initial draw: variant v's seed i trains from train.seed + v·seeds instead of the shared
    train.seed (docs/design.md §7, "Paired comparisons"). Data order is untouched."""
    variants = list(dict.fromkeys(m.variant for m in members))
    n_seeds = max(m.seed for m in members) + 1
    return [dataclasses.replace(m, config=config_lib.replace_field(
        m.config, "train.seed", m.config.train.seed + variants.index(m.variant) * n_seeds)) for m in members]


def _member(base: Config, label: str, seed: int, overrides: dict) -> Member:
    name = re.sub(r"[^A-Za-z0-9=.,_+-]", "_", label) + f"__seed{seed}"  # directory-safe
    cfg = base
    try:
        for key, value in overrides.items():
            cfg = config_lib.replace_field(cfg, key, value)
        cfg = config_lib.replace_field(cfg, "train.seed", cfg.train.seed + seed)
        cfg = checks.check(dataclasses.replace(cfg, name=f"{base.name}/{name}"))
    except ConfigError as e:
        raise ConfigError(f"sweep member {name!r}: {e}") from None
    return Member(name, label, seed, tuple(overrides.items()), cfg)


def _short(key: str) -> str:
    return key.split(".", 1)[1] if "." in key else key

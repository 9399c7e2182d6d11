"""Sweeps: many variants of a config trained as few compiled programs, with seeds and error bars (docs/sweeps.md):
`spec.py` defines them, `runner.py` trains them, `report.py` writes `results.{md,csv,png}`."""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from diffjax import checks, paths
from diffjax import config as config_lib
from diffjax.config import ConfigError
from diffjax.sweep.spec import NUMERIC, Member, Sweep, SweepOptions, product, unpair_init, variants, vary_data, zipped

__all__ = ["NUMERIC", "Member", "Sweep", "SweepOptions", "load", "product", "run", "variants", "zipped"]


def load(spec: str, overrides: typing.Sequence[str] = ()) -> Sweep:
    """Load `"path/to/file.py[:arg]"` defining get_sweep(arg); `--set` overrides apply to every member
    (`sweep.<option>=...` to the sweep's options)."""
    sweep = config_lib.call_file(spec, "get_sweep", Sweep)
    options, assignments = sweep.options, []
    for assignment in overrides:
        if assignment.startswith("sweep."):
            key, sep, value = assignment.partition("=")
            if not sep:
                raise ConfigError(f"override {assignment!r}: expected the form sweep.option=value")
            options = _set_option(options, key.removeprefix("sweep."), value)
        else:
            assignments.append(assignment)
    members = [_override(m, assignments) for m in sweep.members]
    if options.vary_data and not sweep.options.vary_data:
        members = vary_data(members)
    if sweep.options.paired_init and not options.paired_init:
        members = unpair_init(members)
    if options.paired_init and not sweep.options.paired_init:
        raise ConfigError(f"sweep.paired_init=true: {spec} builds its members unpaired (each variant its own "
                          f"train.seed); pair them in its SweepOptions instead")
    return dataclasses.replace(sweep, members=tuple(members), options=options).check()


def run(spec: str, overrides: typing.Sequence[str] = (), workdir: str | Path | None = None, *,
        progress: bool = True) -> Path | None:
    """`diffjax sweep --config SPEC`: load it, say what runs, train (or resume) every group, then write the report
    (process 0). The sweep directory, or None when a signal stopped it (it says so; rerun to resume)."""
    import jax

    from diffjax.sweep.report import write_report
    from diffjax.sweep.runner import run_sweep

    sweep = load(spec, overrides)
    workdir = paths.run_dir(workdir or f"runs/sweeps/{sweep.name}")
    groups = sweep.groups()
    print(f"sweep {sweep.name}: {len(sweep.members)} members in {len(groups)} group(s) "
          f"({', '.join(str(len(g)) for g in groups)} members), workdir {workdir}", flush=True)
    result = run_sweep(sweep, workdir, progress=progress)
    if result.interrupted:
        print(f"interrupted: {result.interrupted}", file=sys.stderr)
        return None
    if jax.process_index() == 0:
        write_report(workdir)
        print((workdir / "results.md").read_text())
    return workdir


def _override(member, assignments: list[str]):
    cfg = member.config
    try:
        for assignment in assignments:
            cfg = config_lib.override(cfg, assignment)
        return dataclasses.replace(member, config=checks.check(cfg))
    except ConfigError as e:
        raise ConfigError(f"sweep member {member.name!r} with --set {' '.join(assignments)}: {e}") from None


def _set_option(options: SweepOptions, field: str, value: str) -> SweepOptions:
    types = typing.get_type_hints(SweepOptions)
    if field not in types:
        raise ConfigError(f"unknown sweep option {field!r}; options: {sorted(types)}")
    coerced = config_lib.coerce(value.strip(), types[field], f"sweep.{field}")
    return dataclasses.replace(options, **{field: coerced}).validate()

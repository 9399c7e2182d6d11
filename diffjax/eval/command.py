"""`diffjax eval`: protocols on runs' latest checkpoints, each written and shown as it finishes (docs/design.md §6)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from diffjax import eval as eval_lib
from diffjax import paths as paths_lib
from diffjax.config import ConfigError, fields_where


def evaluate(runs: list[str], *, protocol: str | None, sets: list[str], compare: bool = False,
             as_json: bool = False, out: str | None = None) -> None:
    """`protocol`: None (the default, fast ones), "all" (every one that applies) or "NAME[,NAME...]"; `sets`:
    `eval.*` protocol options and run overrides (`check_overrides`). Progress on stderr; tables (or JSON) on stdout."""
    import jax

    from diffjax.train.run_loader import load_run

    names = None if protocol in ("all", None) else [n.strip() for n in protocol.split(",")]
    if compare and (names is None or len(names) != 1):
        raise ConfigError("--compare RUN_A RUN_B takes one --protocol NAME and no --workdir")
    options = [a for a in sets if a.startswith("eval.")]
    overrides = [a for a in sets if not a.startswith("eval.")]
    check_overrides(overrides)
    if options and (names is None or len(names) != 1):
        raise ConfigError(f"{' '.join(options)}: protocol options need one --protocol NAME")
    for name in names or ():  # an unknown name or option fails before anything is loaded
        eval_lib.get(name).parse_options(options)
    for run_dir in runs:
        check_not_a_sweep(paths_lib.run_dir(run_dir))
    talk = jax.process_index() == 0
    results = {}
    for run_dir in runs:
        cfg, state, _ = load_run(run_dir, overrides)
        if names is not None:
            protocols = [eval_lib.get(n) for n in names]
        elif protocol is None:
            protocols = [eval_lib.get(n) for n in eval_lib.DEFAULT if eval_lib.get(n).applies(cfg)]
        else:
            protocols = eval_lib.applicable(cfg)
        result, started = {"workdir": run_dir, "step": int(state.step), "overrides": sets}, time.monotonic()
        for i, p in enumerate(protocols):
            if talk:  # progress on stderr: stdout stays the tables (or the JSON of --json)
                eta = "" if not i else f", about {(time.monotonic() - started) / i * (len(protocols) - i):.0f} s left"
                print(f"[{i + 1}/{len(protocols)}] {p.name} on {run_dir} (step {result['step']}){eta}",
                      file=sys.stderr, flush=True)
            result[p.name] = p.run(cfg, state.params, **p.parse_options(options))
            if talk and not compare:  # written and shown as each finishes: a later failure loses nothing
                label = run_label(run_dir, cfg, result["step"])
                paths = write(paths_lib.run_dir(run_dir) / "eval", p, {label: result[p.name]}, {label: result["step"]},
                              sets)
                if not as_json:
                    show(p.name, paths)
        results[run_dir] = result | {"label": run_label(run_dir, cfg, result["step"])}
    if not talk:
        return
    if compare:
        p = eval_lib.get(names[0])
        labels = {d: results[d].pop("label") for d in runs}
        directory = paths_lib.run_dir(out or paths_lib.run_dir(runs[0]) / "eval" /
                                      f"compare-{paths_lib.run_dir(runs[1]).name}")
        paths = write(directory, p, {labels[d]: results[d][p.name] for d in runs},
                      {labels[d]: results[d]["step"] for d in runs}, sets)
        if not as_json:
            show(p.name, paths)
    if as_json:
        print(json.dumps(results if compare else results[runs[0]], indent=2))
    elif protocol is None:
        others = [p.name for p in eval_lib.applicable(cfg) if p.name not in eval_lib.DEFAULT]
        print(f"\nmore protocols for this run: {', '.join(others)} (--protocol NAME[,NAME...] or all)")


def check_overrides(overrides: list[str]) -> None:
    """Refuse to override what the checkpoint is: `--set` takes the fields marked `eval` (`config.setting`), where and
    on what it is evaluated. Any key of a section marked whole passes: the override names an unknown one."""
    settable = fields_where("eval")
    in_whole = lambda key: f"{key.rpartition('.')[0]}.*" in settable  # noqa: E731
    for assignment in overrides:
        key = assignment.partition("=")[0].strip()
        if key not in settable and not in_whole(key):
            keys = [k for k in settable if k.endswith(".*")] + [k for k in settable if not in_whole(k)]
            raise ConfigError(
                f"--set {assignment}: {key} is part of what the checkpoint is (the run's config.json); diffjax eval "
                f"takes {', '.join(keys)} and eval.* (the protocol's options)")


def run_label(run_dir, cfg, step: int) -> str:
    """How tables and figures name a run: its directory, arch and checkpoint step."""
    return f"{paths_lib.resolved(run_dir).name} ({cfg.model.arch}, step {step})"


def show(name: str, paths: dict[str, Path]) -> None:
    """A protocol's table (its JSON where it has none) and the files it wrote."""
    table = paths["md"] if "md" in paths else paths["json"]
    print(f"\n## {name}\n\n{table.read_text().rstrip()}\n\nwrote {', '.join(map(str, paths.values()))}", flush=True)


def check_not_a_sweep(directory: Path) -> None:
    """A sweep directory (the main job's runs/main, say) holds runs; name one of them."""
    if (directory / "sweep.json").is_file() and not (directory / "config.json").is_file():
        members = sorted(p.name for p in (directory / "members").glob("*") if (p / "config.json").is_file())
        raise ConfigError(f"{directory} is a sweep directory, not a run: evaluate one of its members, "
                          f"e.g. --workdir {directory / 'members' / (members or ['<name>'])[0]} "
                          f"(members: {', '.join(members) or 'none finished yet'})")


def write(directory: Path, protocol, results: dict[str, dict], steps: dict[str, int],
          overrides: list[str]) -> dict[str, Path]:
    """NAME.json (with the step and `--set` overrides), NAME.md and NAME.png where defined; the paths, by kind."""
    paths_lib.makedirs(directory)
    only = next(iter(results))
    payload = {"step": steps[only], "overrides": overrides, **results[only]} if len(results) == 1 else \
        {label: {"step": steps[label], "overrides": overrides, **r} for label, r in results.items()}
    paths = {"json": directory / f"{protocol.name}.json"}
    paths["json"].write_text(json.dumps(payload, indent=2))
    if protocol.markdown:
        paths["md"] = directory / f"{protocol.name}.md"
        note = f"\nEvaluated with --set {' '.join(overrides)}\n" if overrides else ""
        paths["md"].write_text(protocol.markdown(results) + note)
    if protocol.plot:
        paths["png"] = protocol.save_plot(results, directory / f"{protocol.name}.png")
    return paths

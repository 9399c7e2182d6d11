"""Compiled per-device memory of the paper's models on accelerator targets, from a CPU host (`diffjax compile`).

    python experiments/compile_table.py --sizes 830M,1.4B --targets v5e-16,h100x8 --out runs/compile_table
    python experiments/compile_table.py --rows "1.4B:v5e-16:data=1,fsdp=-1" "1.4B:v5e-16:data=-1,fsdp=1"

Each row runs `diffjax compile` in its own process (the compiler's memory goes back to the OS between rows); table.md
lists them. LAYOUT: comma-separated mesh (or other config) settings, default fsdp over the whole slice; TARGET@N is
N slices (TPU multislice) or N GPU nodes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
DEFAULT_LAYOUT = "data=1,fsdp=-1"


def _overrides(layout: str) -> list[str]:
    sets = []
    for item in filter(None, layout.split(",")):
        key, value = item.split("=")
        sets += ["--set", f"{key if '.' in key else 'mesh.' + key}={value}"]  # bare keys are mesh axes
    return sets


def compile_row(size: str, arch: str, target: str, layout: str, out: Path) -> dict:
    name = f"{size}_{arch}_{target.replace('@', 'x')}_{layout.replace(',', '_').replace('=', '')}"
    json_path = out / f"{name}.json"
    target_name, _, slices = target.partition("@")  # "h100x8@4": four nodes of 8
    cmd = [sys.executable, "-m", "diffjax.cli", "compile", "--config", f"configs/paper.py:size={size},arch={arch}",
           "--target", target_name, "--num-slices", slices or "1", "--json", str(json_path), *_overrides(layout)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row = {"size": size, "arch": arch, "target": target, "layout": layout, "exit": done.returncode,
           "wall_s": round(time.perf_counter() - start, 1)}
    if json_path.exists():
        row |= json.loads(json_path.read_text())
    else:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    (out / f"{name}.row.json").write_text(json.dumps(row, indent=2))
    return row


def _gib(memory: dict, key: str) -> str:
    return f"{memory[key] / GIB:.2f}" if key in memory else "–"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | target | layout | params + opt | temporaries | total / device memory | fits | kernel | "
             "compile |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("memory", {})
        state = f"{(m['parameters'] + m['optimizer']) / GIB:.2f}" if m else "–"
        fits = {0: "yes", 3: "**no**"}.get(r["exit"], f"error: {r.get('error', '')}")
        kernel = ", ".join(r.get("kernels", {}).values()) or "–"
        lines.append(f"| {r['size']} {r['arch']} | {r['target']} | {r['layout']} | {state} GiB | "
                     f"{_gib(m, 'temporaries')} GiB | {_gib(m, 'total')} / {_gib(m, 'capacity')} GiB | {fits} | "
                     f"{kernel} | {r['wall_s']:.0f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="830M,1.4B,2.8B,6.8B,13.1B,3B")
    p.add_argument("--targets", default="v5e-16,h100x8")
    p.add_argument("--arch", default="diff")
    p.add_argument("--layout", default=DEFAULT_LAYOUT)
    p.add_argument("--rows", nargs="*", help="SIZE:TARGET[:LAYOUT] rows instead of sizes × targets")
    p.add_argument("--out", default="runs/compile_table")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = ([tuple(r.split(":", 2)) + ((args.layout,) if r.count(":") == 1 else ()) for r in args.rows]
            if args.rows else [(s, t, args.layout) for s in args.sizes.split(",") for t in args.targets.split(",")])
    rows = []
    for size, target, layout in plan:
        rows.append(compile_row(size, args.arch, target, layout, out))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    (out / "table.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

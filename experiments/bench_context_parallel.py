"""Context parallelism on fake CPU devices: per-device memory of one train step against the context size N at a
fixed sequence length, and ring vs all_gather step time (docs/design.md §3, "Context parallelism").

    python experiments/bench_context_parallel.py          # T = 16384: memory for N = 1, 2, 4, 8; time at N = 8
    python experiments/bench_context_parallel.py --seq-len 8192 --contexts 1 8 --time-seq-len 4096 --steps 5 \
        --json out.json

Runs on `--devices` fake CPU devices (set here before jax is imported). Memory: XLA's plan per device for the train
step of one sequence on a context × 1 mesh, per N and strategy; time: both strategies' steps at the largest N, in
interleaved rounds (docs/benchmarks.md, "Context parallelism").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/small.py:size=tiny,arch=diff", help="model config spec")
    parser.add_argument("--set", action="append", default=[], metavar="a.b=c", help="config override")
    parser.add_argument("--seq-len", type=int, default=16384, help="sequence length of the memory table")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8], help="context sizes N")
    parser.add_argument("--time-seq-len", type=int, default=8192, help="sequence length of the timing")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per strategy")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices")
    parser.add_argument("--json", help="write every figure to this path")
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None:  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from bench_train import Runner  # noqa: E402
from benchlib import cpu_model, time_interleaved, versions  # noqa: E402

from diffjax import checks, sharding  # noqa: E402
from diffjax.model import param_count  # noqa: E402

STRATEGIES = ("all_gather", "ring")
MiB = 2**20


def load(args, seq_len: int, n: int, strategy: str):
    return checks.load(args.config, [*args.set, f"data.seq_len={seq_len}", "data.batch_size=1", "mesh.data=1",
                                     f"mesh.context={n}", f"model.context_strategy={strategy}"])


def runner(cfg) -> Runner:
    """The config's train state, random batch and compiled step on its context × 1 mesh."""
    return Runner(cfg.model.context_strategy, cfg, sharding.make_mesh(cfg.mesh))


def memory_table(args) -> list[dict]:
    rows = []
    for n in args.contexts:
        for strategy in STRATEGIES if n > 1 else ("unsplit",):
            step = runner(load(args, args.seq_len, n, "all_gather" if strategy == "unsplit" else strategy))
            m = step.step.memory_analysis()
            total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
                     + m.generated_code_size_in_bytes)
            row = {"context": n, "strategy": strategy, "temporaries_mib": m.temp_size_in_bytes / MiB,
                   "arguments_mib": m.argument_size_in_bytes / MiB, "total_mib": total / MiB,
                   "compile_s": step.compile_s}
            rows.append(row)
            print(f"  N={n:<2} {strategy:>10}: temporaries {row['temporaries_mib']:9.1f} MiB, total "
                  f"{row['total_mib']:9.1f} MiB per device (compiled in {row['compile_s']:.1f} s)", flush=True)
    return rows


def timing(args) -> list[dict]:
    n = max(args.contexts)
    steps = [runner(load(args, args.time_seq_len, n, s)) for s in STRATEGIES]
    rows = []
    for name, times in zip(STRATEGIES, time_interleaved([(s.advance, ()) for s in steps], args.warmup, args.steps),
                           strict=True):
        med = statistics.median(times)
        rows.append({"context": n, "strategy": name, "seq_len": args.time_seq_len, "median_s": med,
                     "min_s": min(times), "max_s": max(times), "tokens_per_s": args.time_seq_len / med,
                     "step_times_s": times})
        print(f"  N={n} {name:>10}: median {med:.3f} s (min {min(times):.3f}, max {max(times):.3f}), "
              f"{args.time_seq_len / med:,.0f} tokens/s", flush=True)
    return rows


def main(args) -> dict:
    device_info = {"kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                   "n_devices": jax.device_count(), "cpu": cpu_model(), "cpu_count": len(os.sched_getaffinity(0))}
    library = versions("jax", "jaxlib", "flax")
    model = load(args, args.seq_len, 1, "all_gather").model
    print(f"device: {device_info['n_devices']} fake {device_info['kind']} devices on {device_info['cpu']} "
          f"({device_info['cpu_count']} cores); " + " ".join(f"{k} {v}" for k, v in library.items()))
    print(f"model: {args.config} {args.set or ''} ({param_count(model)['params']:,} parameters, {model.dtype}); "
          f"batch of 1 sequence")
    print(f"\n== memory of one train step, T = {args.seq_len}", flush=True)
    memory = memory_table(args)
    print(f"\n== step time at N = {max(args.contexts)}, T = {args.time_seq_len} (CPU: the devices share "
          f"{device_info['cpu_count']} cores)", flush=True)
    times = timing(args)
    result = {"device": device_info, "versions": library, "config": args.config, "overrides": args.set,
              "model": {k: getattr(model, k) for k in ("arch", "d_model", "n_layers", "n_heads", "head_dim",
                                                         "dtype")},
              "seq_len": args.seq_len, "memory": memory, "timing": times}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from diffjax import host

    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    main(ARGS)

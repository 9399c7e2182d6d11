"""Train-step benchmark: DIFF Transformer vs its parameter-matched Transformer, side by side in one process.

    python experiments/bench_train.py                                            # configs/small.py:size=small
    python experiments/bench_train.py --seq-len 512 --batch 8 --steps 20 --json out.json
    python experiments/bench_train.py --seq-len 512 1024                          # one comparison per length
    python experiments/bench_train.py --config configs/paper.py:size=1.4B --seq-len 2048 4096 --batch 4 \
        --set model.attention_impl=auto      # GPU: DIFF on the Pallas kernel, the baseline on cuDNN

The baseline is the same spec with `arch=transformer` (2h heads of d); `--set` applies to both. Each step is compiled
ahead of time, then after --warmup untimed steps the models' steps run in interleaved rounds (docs/benchmarks.md,
"Train step"). Reported: step times, tokens/s, TFLOP/s and MFU (algorithmic FLOPs, docs/design.md §4; MFU where the
device's peak is known), the step-time ratios and the FLOP ratios, algorithmic and by XLA's cost analysis (optimizer
and softmaxes included). Batches are random tokens, one fixed batch per model: all timing needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

# diffjax first: jax's plugins then load quietly (diffjax/host.py)
import diffjax  # noqa: F401  # isort: skip

import jax
import numpy as np
from benchlib import cpu_model, per_round_ratio, percentile, time_interleaved, versions

from diffjax import config as config_lib
from diffjax import flops, sharding
from diffjax.model import param_count
from diffjax.train import metrics as metrics_lib
from diffjax.train.members import Members, Stack
from diffjax.train.optim import make_optimizer
from diffjax.train.state import state_shardings

BASELINE = "transformer"


def with_arch(spec: str, arch: str) -> str:
    """`configs/x.py:size=small,arch=diff` -> the same spec with `arch=<arch>` (added if absent)."""
    path, _, arg = spec.partition(":")
    items = [a.strip() for a in arg.split(",") if a.strip() and a.split("=", 1)[0].strip() != "arch"]
    return f"{path}:{','.join([*items, f'arch={arch}'])}"


def _batch(cfg, seed: int) -> dict:
    b, t = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(b, t + 1), dtype=np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
            "loss_mask": np.ones((b, t), np.float32)}


class Runner:
    """One model's state, its step (the program `diffjax train` steps: a stack of one) compiled ahead of time, and a
    fixed batch (default: random tokens)."""

    def __init__(self, name: str, cfg, mesh, batch: dict | None = None):
        self.name, self.cfg, self.mesh = name, cfg, mesh
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        stack = Stack(Members.run(cfg, Path(cfg.train.workdir)), mesh, tx, *state_shardings(cfg, mesh, tx))
        self.state = stack.init()
        self.batch = sharding.put_batch(_batch(cfg, seed=0) if batch is None else batch, mesh)
        t0 = time.perf_counter()
        self.step = stack.train_fn().lower(stack.abstract, self.batch).compile()  # takes (state, batch, λ_init=None)
        self.compile_s = time.perf_counter() - t0
        cost = self.step.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        self.xla_flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
        self.metrics = None

    def advance(self):
        """One training step on the fixed batch: (state, metrics), not waited for."""
        self.state, self.metrics = self.step(self.state, self.batch, None)
        return self.state, self.metrics

    def figures(self, times: list[float], peak: float | None) -> dict:
        """Median step, tokens/s, TFLOP/s and MFU (None: peak unknown) from its step `times`, shape, params, FLOPs."""
        seq, tokens = self.cfg.data.seq_len, self.cfg.data.seq_len * self.cfg.data.batch_size
        fpt = flops.train_flops_per_token(self.cfg.model, seq)
        med = statistics.median(times)
        tp = metrics_lib.throughput(tokens, med, fpt, self.mesh.size, peak)
        return dict(arch=self.cfg.model.arch, n_heads=self.cfg.model.n_heads, head_dim=self.cfg.model.head_dim,
                    **param_count(self.cfg.model), flops_per_token=fpt, xla_flops_per_step=self.xla_flops,
                    compile_s=self.compile_s, step_times_s=list(times), median_s=med, p10_s=percentile(times, 10),
                    p90_s=percentile(times, 90), mean_s=statistics.fmean(times), min_s=min(times),
                    tokens_per_s=tp["tokens_per_s"], tflops_per_s=tp["tflops_per_s"], mfu=tp.get("mfu"),
                    final_loss=float(self.metrics["loss"][0]) if self.metrics is not None else float("nan"))


def compare(diff_cfg, base_cfg, mesh, steps: int, warmup: int, peak: float | None) -> dict:
    seq, batch = diff_cfg.data.seq_len, diff_cfg.data.batch_size
    runners = [Runner("diff", diff_cfg, mesh), Runner(BASELINE, base_cfg, mesh)]
    for r in runners:
        print(f"  [{r.name}] compiled in {r.compile_s:.1f} s; XLA cost analysis {r.xla_flops / 1e12:.3f} TFLOP/step",
              flush=True)
    times = time_interleaved([(r.advance, ()) for r in runners], warmup, steps)
    models = {r.name: r.figures(t, peak) for r, t in zip(runners, times, strict=True)}
    d, t = models["diff"], models[BASELINE]
    paired = per_round_ratio(d["step_times_s"], t["step_times_s"])
    return dict(seq_len=seq, batch=batch, tokens_per_step=seq * batch, models=models,
                step_time_ratio=d["median_s"] / t["median_s"],
                step_time_ratio_paired_median=paired["median"],
                step_time_ratio_paired_p10=paired["p10"], step_time_ratio_paired_p90=paired["p90"],
                load_spread=max(m["p90_s"] / m["p10_s"] for m in models.values()),
                step_time_ratio_min=d["min_s"] / t["min_s"],
                flop_ratio=d["flops_per_token"] / t["flops_per_token"],
                xla_flop_ratio=d["xla_flops_per_step"] / t["xla_flops_per_step"])


def print_table(result: dict) -> None:
    print(f"\nseq {result['seq_len']} × batch {result['batch']} = {result['tokens_per_step']} tokens/step")
    print(f"{'model':>12} {'params':>11} {'median s':>9} {'p10-p90 s':>15} {'tokens/s':>10} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'GFLOP/token':>11}")
    for name, m in result["models"].items():
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
        span = f"{m['p10_s']:.3f}-{m['p90_s']:.3f}"
        print(f"{name:>12} {m['params']:>11,} {m['median_s']:>9.3f} {span:>15} {m['tokens_per_s']:>10.1f} "
              f"{m['tflops_per_s']:>8.4f} {mfu:>6} {m['flops_per_token'] / 1e9:>11.4f}")
    print(f"DIFF/Transformer step time: {result['step_time_ratio']:.3f} (medians), "
          f"{result['step_time_ratio_paired_median']:.3f} (median of per-round ratios), "
          f"{result['step_time_ratio_min']:.3f} (minima)")
    if result["load_spread"] > 1.25:
        print(f"note: step times vary {result['load_spread']:.2f}x (p90/p10) — the machine's load changed during "
              "the run; the median of per-round ratios (each round runs both models back to back) is the robust "
              f"figure: {result['step_time_ratio_paired_median']:.3f} (p10-p90 "
              f"{result['step_time_ratio_paired_p10']:.3f}-{result['step_time_ratio_paired_p90']:.3f})")
    print(f"DIFF/Transformer FLOPs: {result['flop_ratio']:.4f} (algorithmic, docs/design.md §4), "
          f"{result['xla_flop_ratio']:.4f} (XLA cost analysis)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/small.py:size=small",
                        help="config spec of the DIFF model; the baseline is the same spec with arch=transformer")
    parser.add_argument("--set", action="append", default=[], metavar="a.b=c", help="override for both models")
    parser.add_argument("--seq-len", type=int, nargs="+", help="sequence length(s); one comparison per value")
    parser.add_argument("--batch", type=int, help="global batch size (data.batch_size)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (interleaved)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model after compilation")
    parser.add_argument("--json", help="write every figure to this path")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be ≥ 1 and --warmup ≥ 0")

    overrides = list(args.set)
    if args.batch is not None:
        overrides.append(f"data.batch_size={args.batch}")
    diff_spec, base_spec = with_arch(args.config, "diff"), with_arch(args.config, BASELINE)
    seqs = args.seq_len or [config_lib.load(diff_spec, overrides).data.seq_len]

    device = jax.devices()[0]
    peak = metrics_lib.peak_flops_per_device(device)
    library_versions = versions("jax", "jaxlib", "flax", "optax", "numpy")
    device_info = dict(kind=device.device_kind, backend=jax.default_backend(), n_devices=jax.device_count(),
                       cpu=cpu_model(), cpu_count=len(os.sched_getaffinity(0)), peak_flops=peak)
    print(f"device: {device.device_kind} ({jax.default_backend()}) × {jax.device_count()}, host CPU "
          f"{device_info['cpu']} ({device_info['cpu_count']} cores); peak "
          f"{'unknown: MFU n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
    print(" ".join(f"{k} {v}" for k, v in library_versions.items()))
    print(f"DIFF: {diff_spec}  baseline: {base_spec}  overrides: {overrides or 'none'}")

    results = []
    for seq in seqs:
        diff_cfg, base_cfg = (config_lib.load(spec, [*overrides, f"data.seq_len={seq}"])
                              for spec in (diff_spec, base_spec))
        if base_cfg.model.arch != BASELINE or diff_cfg.model.arch != "diff":
            raise SystemExit(f"{args.config}: the config did not honour arch= (got {diff_cfg.model.arch}, "
                             f"{base_cfg.model.arch})")
        shared = {k: v for k, v in dataclasses.asdict(diff_cfg.model).items() if k not in ("arch", "n_heads")}
        print(f"\n== seq {seq}: model {shared}", flush=True)
        result = compare(diff_cfg, base_cfg, sharding.make_mesh(diff_cfg.mesh), args.steps, args.warmup, peak)
        result["model"] = shared
        print_table(result)
        results.append(result)

    if args.json:
        meta = dict(device=device_info, versions=library_versions,
                    command=" ".join([Path(sys.executable).name, *sys.argv]),
                    config=args.config, diff_spec=diff_spec, baseline_spec=base_spec, overrides=overrides,
                    steps=args.steps, warmup=args.warmup)
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

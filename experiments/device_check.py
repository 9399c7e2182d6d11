"""One command on a GPU (or TPU) host, within a time budget: the DIFF attention candidates and the 1.4B training step
against the goals (`device_report.GOALS`), the kernels' conformance there, and a short training run
(docs/compile.md, "On the accelerator").

    python experiments/device_check.py --out runs/device_check         # `make device-check`; --budget-s 420 in all
    python experiments/device_check.py --smoke --out /tmp/dc            # the same code, tiny shapes, on a CPU
    python experiments/device_check.py --compile-only --out /tmp/dca    # a CPU host: every GPU program, for an H100

Sections, in order of value (--sections picks some): attention, train_step, conformance, training_run. Each has its
share of what is left of --budget-s (SHARES) as its deadline, and starts a unit of work (a length, a pair of models,
a case) only while the deadline leaves as much time as the last unit took; where it stops, it is reported as cut
short, with what it measured. device_check.json and .md are rewritten in --out after every unit. Exit status: 0 when
no section failed (cut ones included), 1 when one did, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

# Mosaic GPU's interpret mode (how a CPU runs that kernel) deadlocks a small CPU's PJRT thread pool: tests/conftest.py
os.environ.setdefault("PJRT_NPROC", "8")
# diffjax first: jax's plugins then load quietly (diffjax/host.py)
import diffjax  # noqa: F401, E402  # isort: skip

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import FLOP_UNITS, diff_candidates, inputs, is_oom, runnable, step_fn
from bench_train import BASELINE, Runner, with_arch
from benchlib import cpu_model, per_round_ratio, time_interleaved, versions
from device_report import entry_summary, goals, write_report

from diffjax import config as config_lib
from diffjax import kernels, sharding
from diffjax.kernels import conformance
from diffjax.kernels.conformance import Case
from diffjax.train import loop
from diffjax.train import metrics as metrics_lib

SECTIONS = ("attention", "train_step", "conformance", "training_run")
# Shares of the budget. On an H200 the first run took ~25 s for the attention timings, ~30 s per 1.4B model (compile,
# state, steps; six models here) and ~50 s for the training run (docs/benchmarks.md, "Device check: NVIDIA H200").
SHARES = {"attention": 0.15, "train_step": 0.55, "conformance": 0.15, "training_run": 0.15}
TRAIN_MODELS = ("diff", "diff_v2")  # each timed against the Transformer (BASELINE) in its own rounds
# and, where the platform has the Mosaic GPU kernel, DIFF's step on it (the others take what "auto" gives)
MOSAIC_DIFF = "diff_mosaic_gpu"
DTYPES = ("bfloat16", "float32")
# Norm-relative (forward, gradients). bf16 as on CPU (conformance.TOLERANCES); float32: CPU maxima ≤ 8e-7 at S ≤ 256
# grow like √S to ~2e-6 at S = 1024, and 10× on top for the GPU's exp2 and summation order. A real fault (a wrong
# mask, λ's sign, a missing GQA group sum) gives errors of order 0.1-1.
DEVICE_TOLERANCES = {"float32": (2e-5, 5e-5), "bfloat16": (1e-2, 2e-2)}
clock = time.monotonic  # the budget's clock (a test moves it)


def _cases(b: int, t: int, h: int, k: int, d: int, ragged_t: int) -> list[Case]:
    """Causal GQA with and without packed documents, and a ragged length with MQA, per dtype."""
    cases = []
    for dt in DTYPES:
        tag = "bf16" if dt == "bfloat16" else "f32"
        cases += [Case(f"{tag}_causal_gqa", b, t, h, k, d, dt, True),
                  Case(f"{tag}_causal_gqa_segments", b, t, h, k, d, dt, True, segments=True),
                  Case(f"{tag}_causal_ragged{ragged_t}_mqa", 1, ragged_t, h, 1, d, dt, True)]
    return cases


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes, counts and time of one run: FULL on a device, SMOKE anywhere."""

    budget_s: float
    cases: list[Case]
    attention_config: str  # its DIFF model's head shape (the baseline: the same spec with arch=transformer)
    attention_seqs: tuple[int, ...]
    attention_warmup: int
    attention_reps: int
    train_config: str
    train_seqs: tuple[int, ...]  # the first is where the MFU goal is read
    train_batch_per_device: int
    train_warmup: int
    train_steps: int
    train_overrides: tuple[str, ...]
    run_config: str
    run_steps: int
    run_overrides: tuple[str, ...]
    run_estimate_s: float  # the training run is started only with this much time left (it cannot stop midway)


FULL = Plan(
    budget_s=420, cases=_cases(2, 1024, 8, 2, 128, ragged_t=1000),
    attention_config="configs/paper.py:size=3B", attention_seqs=(2048, 4096, 8192), attention_warmup=2,
    attention_reps=20,
    train_config="configs/paper.py:size=1.4B", train_seqs=(2048, 4096), train_batch_per_device=4, train_warmup=2,
    train_steps=10, train_overrides=(),
    run_config="configs/small.py:size=small,arch=diff", run_steps=50,
    # bf16: what an accelerator trains in, so the run goes through the fused kernel's bf16 path
    run_overrides=("model.dtype=bfloat16", "optim.warmup_steps=10"), run_estimate_s=50,
)
MQAR = ("data.tasks=mqar", "data.mqar_pairs=6", "data.mqar_queries=6")  # a task that fits 64 tokens
SMOKE = Plan(
    budget_s=1800, cases=[c for c in _cases(1, 32, 2, 1, 16, ragged_t=40) if "ragged" not in c.name],
    attention_config="configs/small.py:size=tiny", attention_seqs=(128,), attention_warmup=1, attention_reps=3,
    train_config="configs/small.py:size=tiny", train_seqs=(64,), train_batch_per_device=2, train_warmup=1,
    # bf16 as on a device (its kernels: cuDNN's on a GPU); random tokens are timed, the data settings need only be valid
    train_steps=2, train_overrides=("model.dtype=bfloat16", *MQAR),
    run_config="configs/small.py:size=tiny,arch=diff", run_steps=20,
    run_overrides=("data.seq_len=64", "data.batch_size=8", *MQAR, "optim.warmup_steps=2"), run_estimate_s=0,
)


class BadInput(Exception):
    """Bad command-line input: one line, exit status 2."""


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"


@dataclasses.dataclass
class Context:
    """What a section needs; `target` (compile-only): the deviceless target to compile for instead of running here."""

    plan: Plan
    platform: str  # "gpu" | "tpu": whose kernels
    deadline: float = math.inf  # the section's end on `clock`
    target: object = None  # diffjax.aot.targets.Target
    trace: Path | None = None  # where the train step's XProf traces go (--trace)
    save: Callable[[dict], None] = lambda partial: None  # noqa: E731  (set by `run`: the section's result so far)
    compile_s: float | None = 0.0  # the section's compile time so far (None: not measured apart)
    cut: dict | None = None  # where `units` stopped for the deadline

    @property
    def compile_only(self) -> bool:
        return self.target is not None

    def units(self, items, estimate_s: float = 0.0, name=str):
        """`items`, each started only while the deadline leaves the time the one before took (the first:
        `estimate_s`); else `cut` records where it stopped."""
        items = list(items)
        for done, item in enumerate(items):
            left = self.deadline - clock()
            if not left > max(estimate_s, 0.0):
                self.cut = dict(done=done, of=len(items), next=name(item), left_s=max(0.0, left), needed_s=estimate_s)
                return
            start = clock()
            yield item
            estimate_s = clock() - start

    def kernel(self, impl: str, op: str) -> Callable:
        """The registry's `op` of `impl`: for the target, else as this host runs it (`runnable`)."""
        if self.compile_only:
            with kernels.targeting(self.platform):
                return kernels.resolve(impl, op)
        return runnable(impl, op)[0]

    def arrays(self, make: Callable):
        """make()'s arrays, or in compile-only runs their shapes."""
        return jax.eval_shape(make) if self.compile_only else make()

    def compile(self, fn: Callable, *args):
        """fn compiled ahead of time for `args` (arrays or shapes): here, or for the target; (compiled, seconds)."""
        t0 = time.perf_counter()
        if not self.compile_only:
            compiled = jax.jit(fn).lower(*args).compile()
        else:
            from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

            from diffjax.aot import targets

            devices = _target_devices(self.target)
            mesh = Mesh(np.array(devices[:1]), ("x",), axis_types=(AxisType.Auto,))
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=NamedSharding(mesh, PartitionSpec())), args)
            # the mesh: newer JAX reads the target GPU from it (Triton); the target's devices answer cuDNN's
            # capability check; uncached: no client here loads these programs back
            with kernels.targeting(self.platform), jax.set_mesh(mesh), targets.capability_of(devices), \
                    targets.uncached():
                compiled = jax.jit(fn).lower(*shapes).compile()
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        return compiled, seconds

    def finish(self, result: dict, entries: list[dict]) -> dict:
        """The section's status from its entries and whether its units were cut."""
        failed = any(e["status"] not in ("ok", "passed", "skipped") for e in entries)
        return result | dict(status="failed" if failed else "cut" if self.cut else "ok", cut=self.cut)


@functools.cache
def _target_devices(target) -> list:
    from diffjax.aot import targets

    return targets.devices(target)


def attention_section(ctx: Context, out: Path) -> dict:
    """Per T: each candidate's and the standard op's (2h heads) forward+backward ms, and per-round ratios; the Mosaic
    GPU kernel once per tile candidate that passes conformance first (`tile_rows`), the fastest kept (`tune`)."""
    plan = ctx.plan
    candidates = diff_candidates(ctx.platform)
    standard = kernels.choice("auto", "attention", ctx.platform, "bfloat16")
    if not candidates or standard == "xla":
        return dict(status="skipped", reason=f"no fused attention kernels on {ctx.platform} (DIFF candidates "
                                             f"{candidates}, standard attention {standard})")
    models = {arch: config_lib.load(with_arch(plan.attention_config, arch)).model for arch in ("diff", BASELINE)}
    _check_query_heads(models)
    h, d = models["diff"].n_heads, models["diff"].head_dim
    # key: (inputs, impl, op, tile settings or None)
    rows = {name: ("diff", name, "diff_attention", None) for name in candidates if name != "mosaic_gpu"}
    tiles = tile_rows(ctx, d) if "mosaic_gpu" in candidates else {}
    # the other head class's tiles are checked, not timed: every split runs on the hardware before anything chooses it
    # (at d ≤ 64: dQ formed in the dK/dV kernel and reduce-added by TMA, which no interpreter runs)
    checked = tiles | {f"{name} (d = {other})": found for other in ([64 if d > 64 else 128] if tiles else [])
                       for name, found in tile_rows(ctx, other).items()}
    rows |= {f"mosaic_gpu {name}": ("diff", "mosaic_gpu", "diff_attention", blocks)
             for name, (blocks, entry) in tiles.items() if entry["status"] in ("passed", "ok")}
    rows["standard"] = ("standard", standard, "attention", None)
    # a fused kernel's one map
    own = [n for n in candidates if n != standard and kernels.refusal(n, kernels.Call("attention")) is None]
    rows |= {f"{n} standard": ("standard", n, "attention", None) for n in own}
    auto = kernels.choice("auto", "diff_attention", ctx.platform, "bfloat16")
    if auto == "mosaic_gpu":  # its row: the tiles `get_default` gives at this head dim
        from diffjax.kernels import mosaic_gpu

        default = mosaic_gpu.BlockSizes.get_default(d)
        auto = next((k for k, r in rows.items() if r[1] == "mosaic_gpu" and r[3] == default), auto)
    result = dict(status="running", config=plan.attention_config, impls=candidates, own_standard=own, auto=auto,
                  candidates=[k for k, r in rows.items() if r[0] == "diff"], standard=standard,
                  diff_heads=h, standard_heads=2 * h, head_dim=d, v_head_dim=2 * d, batch=1, dtype="bfloat16",
                  causal=True, mode="fwd+bwd", warmup=plan.attention_warmup, reps=plan.attention_reps,
                  flop_units=FLOP_UNITS, seqs=list(plan.attention_seqs), cells=[],
                  tile_conformance={name: entry for name, (_, entry) in checked.items()})
    for seq in ctx.units(plan.attention_seqs, name=lambda seq: f"T = {seq}"):
        cell = dict(seq=seq, compile_s={})
        try:
            calls = {}
            for key, (kind, impl, op, blocks) in rows.items():
                args, ct = ctx.arrays(functools.partial(inputs, kind, 1, seq, h, d, jnp.bfloat16))
                kernel = ctx.kernel(impl, op)
                kernel = kernel if blocks is None else functools.partial(kernel, block_sizes=blocks)
                program = step_fn(functools.partial(kernel, causal=True), "fwd+bwd")
                compiled, cell["compile_s"][key] = ctx.compile(program, args, ct)
                calls[key] = (compiled, (args, ct))
            if not ctx.compile_only:
                _time_cell(cell, calls, rows, ctx, h, d)
            cell["status"] = "ok"
        except Exception as err:  # noqa: BLE001  one failed length must not end the section
            cell |= dict(status="OOM" if is_oom(err) else "error", error=_error(err))
        print(f"  attention T={seq}: {_cell_line(cell, list(rows))}", flush=True)
        result["cells"].append(cell)
        ctx.save(result)
    if tiles and not ctx.compile_only:
        result["tuned"] = tune(result, d, out)
    # a tile candidate that fails (to compile, or conformance) fails the section, the others timed all the same
    return ctx.finish(result, result["cells"] + list(result["tile_conformance"].values()))


def tile_rows(ctx: Context, d: int) -> dict:
    """{name: (BlockSizes, conformance entry)} of the Mosaic GPU kernel's tile candidates at head dim d, each checked
    against the reference on the plan's bf16 case with packed documents before anything times it (compiled only, in
    a compile-only run): a split that only hardware runs is timed only once it has passed here."""
    from diffjax.kernels import mosaic_gpu

    case = next(c for c in ctx.plan.cases if c.dtype == "bfloat16" and c.segments)
    case = dataclasses.replace(case, name=f"{case.name}_d{d}", d=d)
    found = {}
    for name, blocks in mosaic_gpu.candidates(d).items():
        fn = functools.partial(ctx.kernel("mosaic_gpu", "diff_attention"), block_sizes=blocks)
        try:
            entry = (_compile_entry(ctx, "diff_attention", "mosaic_gpu", fn, case) if ctx.compile_only
                     else check_entry("diff_attention", "mosaic_gpu", fn, case))
        except Exception as err:  # noqa: BLE001  a candidate that fails is reported and not timed
            entry = _entry("diff_attention", "mosaic_gpu", case, status="error", error=_error(err))
        print(f"  mosaic_gpu tiles {name} (d = {d}): {entry['status']} {entry_summary(entry)}", flush=True)
        found[name] = (blocks, entry)
    return found


def tune(result: dict, d: int, out: Path) -> dict | None:
    """The fastest timed tile candidate (geometric mean over T of its time / the cuDNN composition's), written on a GPU
    as the table `mosaic_gpu.BlockSizes.get_default` and "auto" read (mosaic_gpu.TUNED's format) to --out; None
    without cuDNN's times or a timed candidate."""
    from diffjax.kernels import mosaic_gpu

    cells = [c for c in result["cells"] if c["status"] == "ok" and "cudnn" in c]
    timed = {k.removeprefix("mosaic_gpu "): [c[k]["ms"] / c["cudnn"]["ms"] for c in cells]
             for k in (cells[0] if cells else {}) if k.startswith("mosaic_gpu ") and k != "mosaic_gpu standard"}
    if not timed:
        return None
    vs = {name: math.exp(statistics.fmean(map(math.log, ratios))) for name, ratios in timed.items()}
    best = min(vs, key=vs.get)
    entry = dict(head_dim=64 if d <= 64 else 128, causal=True, tiles=best,
                 blocks=dataclasses.asdict(mosaic_gpu.candidates(d)[best]), vs_cudnn=vs[best],
                 candidates_vs_cudnn=vs, seqs=[c["seq"] for c in cells], device=_device_info(None)["kind"],
                 versions=versions("jax", "jaxlib"), date=datetime.date.today().isoformat(),
                 command="python experiments/device_check.py --sections attention")
    if jax.default_backend() != "gpu":  # interpret mode's times (--smoke on a CPU) must never set a GPU's tiles
        print(f"  mosaic_gpu tiles: {best} fastest here; no table written (timed on {jax.default_backend()})")
        return entry
    path = out / mosaic_gpu.TUNED.name
    path.write_text(json.dumps({"entries": [entry]}, indent=1) + "\n")
    print(f"  mosaic_gpu tiles: {best} fastest, {vs[best]:.3f}× cuDNN's composition -> {path} (copy it to "
          f"diffjax/kernels/ to make it the default)", flush=True)
    return entry


def _time_cell(cell: dict, calls: dict, rows: dict, ctx: Context, h: int, d: int) -> None:
    plan, seq = ctx.plan, cell["seq"]
    times = dict(zip(calls, time_interleaved(list(calls.values()), plan.attention_warmup, plan.attention_reps,
                                             ctx.deadline), strict=True))
    for key, (kind, impl, *_) in rows.items():
        flop = FLOP_UNITS[kind]["fwd+bwd"] * h * seq * seq * d / 2  # causal halves
        median = statistics.median(times[key])
        cell[key] = dict(impl=impl, ms=1e3 * median, times_s=times[key], tflops=flop / median / 1e12)
        if key != "standard":
            cell[key]["ratio"] = per_round_ratio(times[key], times["standard"])
    cell["rounds"] = len(times["standard"])


def _cell_line(cell: dict, keys: list[str]) -> str:
    if cell["status"] != "ok":
        return f"{cell['status']} {cell['error']}"
    if "standard" not in cell:
        return "compiled: " + ", ".join(f"{k} {s:.1f} s" for k, s in cell["compile_s"].items())
    return ", ".join(f"{k} {cell[k]['ms']:.3f} ms" + (f" ({cell[k]['ratio']['median']:.3f}×)" if k != "standard"
                                                      else "") for k in keys)


def train_step_section(ctx: Context) -> dict:
    """Per (T, model in TRAIN_MODELS, and MOSAIC_DIFF where the platform has the kernel): the model and the Transformer
    timed in interleaved rounds; the Transformer is kept for the next model at the same T, the model dropped before
    the next is built."""
    plan = ctx.plan
    n_devices = len(_target_devices(ctx.target)) if ctx.compile_only else jax.device_count()
    batch = plan.train_batch_per_device * n_devices
    cfgs = {seq: {arch: config_lib.load(with_arch(plan.train_config, arch),
                                        [*overrides_for(arch, plan.train_overrides), f"data.seq_len={seq}",
                                         f"data.batch_size={batch}"])
                  for arch in (BASELINE, *TRAIN_MODELS)} for seq in plan.train_seqs}
    _check_query_heads({arch: cfg.model for arch, cfg in next(iter(cfgs.values())).items()})
    models = list(TRAIN_MODELS)
    if "mosaic_gpu" in diff_candidates(ctx.platform):
        models.insert(1, MOSAIC_DIFF)  # after DIFF on "auto", before DIFF V2: the kernel's step ratio is the open one
        for by_arch in cfgs.values():
            by_arch[MOSAIC_DIFF] = config_lib.override(by_arch["diff"], "model.attention_impl=mosaic_gpu")
    peak = None if ctx.compile_only else metrics_lib.peak_flops_per_device(jax.devices()[0])
    result = dict(status="running", config=plan.train_config, models=models, baseline=BASELINE,
                  overrides=list(plan.train_overrides), warmup=plan.train_warmup, steps=plan.train_steps,
                  peak_flops=peak, seqs=list(plan.train_seqs), batch=batch, results=[])
    held = {}  # the Transformer's runner (or compile report) at the current T
    for seq, arch in ctx.units([(seq, arch) for seq in plan.train_seqs for arch in models],
                               name=lambda unit: f"T = {unit[0]}, {unit[1]}"):
        print(f"  train step T={seq}, batch {batch}: {arch} vs {BASELINE}", flush=True)
        try:
            if held.get("seq") != seq:
                held.clear()  # the last T's Transformer freed before this one is built
                held.update(seq=seq, base=_build(ctx, BASELINE, cfgs[seq][BASELINE]))
            entry = (_compile_pair(ctx, arch, cfgs[seq][arch], held["base"]) if ctx.compile_only
                     else _time_pair(ctx, arch, cfgs[seq][arch], held["base"], peak))
        except Exception as err:  # noqa: BLE001
            entry = dict(status="OOM" if is_oom(err) else "error", error=_error(err))
            traceback.print_exc()
        result["results"].append(dict(seq_len=seq, batch=batch, model=arch) | entry)
        ctx.save(result)
    return ctx.finish(result, result["results"])


def overrides_for(arch: str, overrides) -> list[str]:
    """The train-step overrides that apply to `arch`: `key=value` to every model, `ARCH:key=value` to that arch's."""
    picked = []
    for override in overrides:
        key = override.split("=", 1)[0]
        scope = key.partition(":")[0] if ":" in key else ""
        if scope in ("", arch):
            picked.append(override.removeprefix(f"{scope}:") if scope else override)
    return picked


def _check_query_heads(models: dict) -> None:
    """DIFF's and DIFF V2's h heads of d against the Transformer's 2h, the pairs `diffjax summary` reports."""
    base = models[BASELINE]
    for arch, m in models.items():
        if arch != BASELINE and (2 * m.n_heads, m.head_dim) != (base.n_heads, base.head_dim):
            raise RuntimeError(f"{arch}: {m.n_heads} heads of {m.head_dim}, not half the {BASELINE}'s "
                               f"{base.n_heads} heads of {base.head_dim}")


def _build(ctx: Context, arch: str, cfg, base=None):
    """The model's runner (on the mesh of `base`, if given), or in compile-only runs its step's compile report."""
    if ctx.compile_only:
        from diffjax.aot.compile import compile_train_step

        built = compile_train_step(cfg, ctx.target)
    else:
        built = Runner(arch, cfg, base.mesh if base else sharding.make_mesh(cfg.mesh))
    ctx.compile_s += built.compile_s
    return built


def _time_pair(ctx: Context, arch: str, cfg, base: Runner, peak) -> dict:
    runner, plan = _build(ctx, arch, cfg, base), ctx.plan  # (dropped on return: two models' states at a time)
    calls = [(runner.advance, ()), (base.advance, ())]
    times = time_interleaved(calls, plan.train_warmup, plan.train_steps, ctx.deadline)
    models = {arch: runner.figures(times[0], peak), BASELINE: base.figures(times[1], peak)}
    ratio = per_round_ratio(times[0], times[1])
    print(f"  {arch} / {BASELINE} at T={cfg.data.seq_len}: {ratio['median']:.3f} ({len(times[0])} rounds)", flush=True)
    entry = dict(status="ok", models=models, ratio=ratio, rounds=len(times[0]),
                 flop_ratio=models[arch]["flops_per_token"] / models[BASELINE]["flops_per_token"])
    if ctx.trace:  # after the timing, which a trace would slow: two more rounds, each step's kernels on the device
        try:
            with jax.profiler.trace(str(ctx.trace / f"T{cfg.data.seq_len}_{arch}")):
                time_interleaved(calls, 0, 2)
            entry["trace"] = str(ctx.trace / f"T{cfg.data.seq_len}_{arch}")
        except Exception as err:  # noqa: BLE001  a profiler that cannot run here must not cost the timings
            entry["trace_error"] = _error(err)
    return entry


def _compile_pair(ctx: Context, arch: str, cfg, base) -> dict:
    """Compile-only: the pair fits when either step's memory plus the other model's state fits the device."""
    reports = {arch: _build(ctx, arch, cfg), BASELINE: base}
    state = {k: r.memory["parameters"] + r.memory["optimizer"] + r.memory["batch"] for k, r in reports.items()}
    need = max(reports[a].memory.get("total", math.inf) + state[b] for a, b in ((arch, BASELINE), (BASELINE, arch)))
    capacity = reports[arch].memory["capacity"]
    fits = need <= capacity and all(r.fits for r in reports.values())
    return dict(status="ok" if fits else "failed", pair_bytes=need, capacity_bytes=capacity, pair_fits=fits,
                compiled={k: dict(compile_s=r.compile_s, kernels=r.kernels, total_bytes=r.memory.get("total"),
                                  fits=r.fits, compiler_error=r.compiler_error) for k, r in reports.items()})


def conformance_targets(platform: str) -> tuple[list[tuple[str, str, str]], list[dict]]:
    """([(op, impl, dtype)] to check: every DIFF candidate and "auto"'s standard op unless xla, skipped entries)."""
    todo, skipped = [], []
    for dtype in DTYPES:
        todo += [("diff_attention", name, dtype) for name in diff_candidates(platform, dtype)]
        standard = kernels.choice("auto", "attention", platform, dtype)
        if standard == "xla":
            skipped.append(dict(op="attention", impl="xla", dtype=dtype, status="skipped",
                                reason=f'"auto" picks xla for attention in {dtype} on {platform}: the oracle itself'))
        else:
            todo.append(("attention", standard, dtype))
    return todo, skipped


def _entry(op: str, impl: str, case: Case, **fields) -> dict:
    return dict(op=op, impl=impl, case=dataclasses.asdict(case), dtype=case.dtype, **fields)


def check_entry(op: str, impl: str, fn: Callable, case: Case) -> dict:
    """One conformance entry: `fn` (the impl's `op`) against the float32 XLA reference on `case`."""
    seed = zlib.crc32(f"{op}/{impl}/{case.name}".encode())
    check = conformance.check_diff if op == "diff_attention" else conformance.check_attention
    result = check(fn, case, seed, DEVICE_TOLERANCES)
    return _entry(op, impl, case) | result | dict(status="passed" if result["passed"] else "failed")


def _compile_entry(ctx: Context, op: str, impl: str, fn: Callable, case: Case) -> dict:
    """Compile-only: the program a conformance entry runs on the kernel (forward and every gradient)."""
    args, seg, ct = conformance.make_inputs(case, 0)
    if op == "attention":
        args = (args[0], args[2], args[4])

    def forward_and_back(args, seg, ct):
        out, pull = jax.vjp(lambda *a: fn(*a, causal=case.causal, segment_ids=seg), *args)
        return out, pull(ct.astype(out.dtype))

    _, seconds = ctx.compile(forward_and_back, args, seg, ct)
    return _entry(op, impl, case, status="ok", compile_s=seconds)


def conformance_section(ctx: Context) -> dict:
    if not ctx.compile_only:
        ctx.compile_s = None  # compiled inside conformance's own calls: not told apart from running
    todo, skipped = conformance_targets(ctx.platform)
    result = dict(status="running", tolerances=DEVICE_TOLERANCES, results=[], skipped=skipped)
    work = [(op, impl, case) for op, impl, dtype in todo for case in ctx.plan.cases if case.dtype == dtype]
    # float32 matmuls for float32 inputs: JAX's TPU flash attention follows this setting (the Pallas kernels ask)
    with jax.default_matmul_precision("highest"):
        for op, impl, case in ctx.units(work, name=lambda w: f"{w[1]} {w[0]} {w[2].name}"):
            how = None if ctx.compile_only else runnable(impl, op)[1]
            t0 = time.perf_counter()
            try:
                fn = ctx.kernel(impl, op)
                entry = (_compile_entry(ctx, op, impl, fn, case) if ctx.compile_only
                         else check_entry(op, impl, fn, case))
            except Exception as err:  # noqa: BLE001  a kernel that cannot run here is a failed entry, not the end
                entry = _entry(op, impl, case, status="error", error=_error(err))
            entry |= dict(emulated=how, seconds=time.perf_counter() - t0)
            result["results"].append(entry)
            print(f"  conformance {op} {impl}{f' ({how})' if how else ''} {case.name}: {entry['status']} "
                  f"{entry_summary(entry)}", flush=True)
            ctx.save(result)
    return ctx.finish(result, result["results"])


def training_run_section(ctx: Context, out: Path) -> dict:
    plan = ctx.plan
    n = plan.run_steps
    overrides = [f"train.steps={n}", "train.log_every=1", f"train.eval_every={n}", f"train.checkpoint_every={n}",
                 "train.eval_batches=1", "train.telemetry_every=0", *plan.run_overrides]
    cfg = config_lib.load(plan.run_config, overrides)
    result = dict(status="running", config=plan.run_config, overrides=overrides,
                  model=dict(arch=cfg.model.arch, dtype=cfg.model.dtype, d_model=cfg.model.d_model,
                             n_layers=cfg.model.n_layers, attention_impl=cfg.model.attention_impl,
                             attention_kernel=kernels.choice(cfg.model.attention_impl, "diff_attention",
                                                             ctx.platform, cfg.model.dtype)))
    if not ctx.compile_only:
        ctx.compile_s = None  # compiled inside the train loop: not told apart from running
    for _ in ctx.units([plan.run_config], estimate_s=plan.run_estimate_s):
        result |= _compile_run(ctx, cfg) if ctx.compile_only else _train(cfg, out)
    ok = result.get("fits", result.get("loss_went_down"))
    return ctx.finish(result, [] if ctx.cut else [dict(status="ok" if ok else "failed")])


def _compile_run(ctx: Context, cfg) -> dict:
    report = _build(ctx, cfg.model.arch, cfg)
    return dict(compile_s=report.compile_s, kernels=report.kernels, fits=report.fits,
                total_bytes=report.memory.get("total"), capacity_bytes=report.memory["capacity"])


def _train(cfg, out: Path) -> dict:
    # a fresh directory per check (never one an earlier check, or anyone else, left there)
    workdir = Path(tempfile.mkdtemp(prefix="training_run-", dir=out))
    t0 = time.perf_counter()
    run = loop.train(cfg, workdir, progress=False)
    seconds = time.perf_counter() - t0
    losses = {r["step"]: r["loss"] for r in metrics_lib.read_metrics(workdir) if r["split"] == "train"}
    steps = sorted(losses)
    k = max(1, len(steps) // 5)
    first, last = statistics.fmean(losses[s] for s in steps[:k]), statistics.fmean(losses[s] for s in steps[-k:])
    print(f"  training run: {len(steps)} steps, loss {first:.4f} (first {k}) -> {last:.4f} (last {k})", flush=True)
    return dict(steps=run.step, seconds=seconds, losses=[losses[s] for s in steps], window=k, first_loss=first,
                last_loss=last, loss_went_down=math.isfinite(last) and last < first,
                tokens_per_s=(run.train or {}).get("tokens_per_s"), val_loss=(run.val or {}).get("loss"),
                workdir=str(workdir))


RUNNERS = {"attention": lambda ctx, out: attention_section(ctx, out),
           "train_step": lambda ctx, out: train_step_section(ctx),
           "conformance": lambda ctx, out: conformance_section(ctx),
           "training_run": training_run_section}


def _device_info(target) -> dict:
    host = dict(cpu=cpu_model(), cpu_count=len(os.sched_getaffinity(0)))
    if target is not None:
        devices = _target_devices(target)
        return dict(kind=devices[0].device_kind, platform=target.platform, count=len(devices),
                    target=target.name) | host
    device = jax.devices()[0]
    return dict(kind=device.device_kind, platform=jax.default_backend(), count=jax.device_count(),
                compute_capability=getattr(device, "compute_capability", None)) | host


def kernel_platform(target) -> str:
    """Whose kernels the check measures: the target's; this host's accelerator; on a CPU, a GPU's (`runnable`)."""
    if target is not None:
        return target.platform
    backend = kernels.normalize_platform(jax.default_backend())
    return backend if backend in ("gpu", "tpu") else "gpu"


def _seconds(x: float) -> str:
    return f"{x:.0f} s" if math.isfinite(x) else "unlimited"


def run(sections, plan: Plan, out: Path, command: str, budget_s: float, *, smoke: bool, target=None,
        trace: Path | None = None) -> dict:
    """Run `sections` in order, each by its deadline: its share (SHARES) of the time left of `budget_s` among itself
    and those after it (time a section leaves unused passes on). The report, written after every unit, returned."""
    platform, end = kernel_platform(target), clock() + budget_s
    meta = dict(device=_device_info(target), versions=versions("jax", "jaxlib", "flax", "optax", "numpy"),
                command=command, smoke=smoke, compile_only=target is not None, kernel_platform=platform,
                sections=list(sections), budget_s=budget_s, shares={s: SHARES[s] for s in sections},
                started=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    mode = " — SMOKE RUN" if smoke else ""
    mode += f" — COMPILE ONLY for {target.name}" if target is not None else ""
    print(f"device check on {meta['device']['kind']} ({meta['device']['platform']} × {meta['device']['count']})"
          f"{mode}; kernels for {platform}; budget {_seconds(budget_s)}", flush=True)
    report = dict(meta=meta, passed=True, complete=True, goals=[], sections={})
    t_start = time.perf_counter()

    def save(name: str, ctx: Context, t0: float, section_s: float, result: dict) -> None:
        report["sections"][name] = result | dict(seconds=time.perf_counter() - t0, compile_s=ctx.compile_s,
                                                 budget_s=section_s)
        statuses = [s["status"] for s in report["sections"].values()]
        report.update(passed=all(s in ("ok", "skipped", "cut", "running") for s in statuses),
                      complete=len(statuses) == len(sections) and not {"cut", "running"} & set(statuses),
                      goals=goals(report["sections"], plan))
        meta["wall_s"] = time.perf_counter() - t_start
        write_report(out, report)

    for i, name in enumerate(sections):
        print(f"== {name}", flush=True)
        section_s = max(0.0, end - clock()) * SHARES[name] / sum(SHARES[s] for s in sections[i:])
        ctx = Context(plan, platform, clock() + section_s, target=target, trace=trace)
        ctx.save = functools.partial(save, name, ctx, time.perf_counter(), section_s)
        try:
            result = RUNNERS[name](ctx, out)
        except Exception as err:  # noqa: BLE001  a broken section is reported; the others still run
            traceback.print_exc()
            result = dict(status="error", error=_error(err))
        ctx.save(result)
        s = report["sections"][name]
        compiling = "" if s["compile_s"] is None else f", of which compiling {s['compile_s']:.1f} s"
        print(f"   {name}: {s['status']} ({s['seconds']:.1f} s{compiling}; budget {_seconds(s['budget_s'])})",
              flush=True)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/device_check", help="directory for device_check.json and .md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: test the script anywhere, in minutes")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="run only these sections (default: all, in the order above)")
    parser.add_argument("--budget-s", type=float,
                        help=f"seconds for all sections (default {FULL.budget_s:.0f}; --smoke {SMOKE.budget_s:.0f}; "
                             "--compile-only unlimited)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every program for --target on this host (no GPU needed), run nothing")
    parser.add_argument("--target", help="compile-only: the target (default h100x1; diffjax.aot.targets names)")
    parser.add_argument("--cache-dir", help="JAX's persistent compilation cache (default $JAX_COMPILATION_CACHE_DIR, "
                                            "else OUT/jax_cache)")
    parser.add_argument("--train-set", action="append", default=[], metavar="[ARCH:]KEY=VALUE",
                        help="a config override of the train step's models (e.g. model.remat=attention), or of one "
                             "arch's (diff:model.attention_impl=cudnn_wide_v); repeatable")
    parser.add_argument("--trace", action="store_true",
                        help="after timing each train-step pair, two more rounds under jax.profiler (XProf) into "
                             "OUT/trace: where each step's time goes, kernel by kernel")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    plan = dataclasses.replace(plan, train_overrides=(*plan.train_overrides, *args.train_set))
    try:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise BadInput(f"--out {args.out}: exists and is not a directory")
        if args.budget_s is not None and not args.budget_s > 0:
            raise BadInput(f"--budget-s must be > 0, got {args.budget_s}")
        if args.target and not args.compile_only:
            raise BadInput("--target: only with --compile-only (a run measures the device it runs on)")
        for arch in (BASELINE, *TRAIN_MODELS):  # a bad --train-set stops here, before any device time
            config_lib.load(with_arch(plan.train_config, arch), overrides_for(arch, plan.train_overrides))
        target = _compile_target(args.target or "h100x1") if args.compile_only else None
        if target is None and jax.default_backend() not in ("gpu", "tpu") and not args.smoke:
            raise BadInput(f"no GPU or TPU here (jax backend {jax.default_backend()!r}): the device check needs one; "
                           "--smoke runs its code path with tiny shapes on a CPU, --compile-only compiles it for one")
        out.mkdir(parents=True, exist_ok=True)
    except (BadInput, config_lib.ConfigError, OSError) as err:
        print(f"device_check: {err}", file=sys.stderr)
        return 2
    if target is None:  # (compile-only programs are for a device this host has not: never cached)
        cache = args.cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(out / "jax_cache")
        jax.config.update("jax_compilation_cache_dir", cache)
    command = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else \
        " ".join(["python", "experiments/device_check.py", *argv])
    sections = [s for s in SECTIONS if s in args.sections]
    budget_s = args.budget_s or (math.inf if args.compile_only else plan.budget_s)
    report = run(sections, plan, out, command, budget_s, smoke=args.smoke, target=target,
                 trace=out / "trace" if args.trace else None)
    cut = [n for n, s in report["sections"].items() if s["status"] == "cut"]
    state = ("passed" if report["passed"] else "FAILED") + (f"; cut short: {', '.join(cut)}" if cut else "")
    print(f"wrote {out / 'device_check.json'} and {out / 'device_check.md'}: {state} in "
          f"{report['meta']['wall_s']:.0f} s", flush=True)
    return 0 if report["passed"] else 1


def _compile_target(name: str):
    """The deviceless target of a compile-only run; BadInput where this host cannot build its devices."""
    from diffjax.aot import targets

    target = targets.parse(name)
    try:
        _target_devices(target)
    except targets.TargetUnavailable as err:
        raise BadInput(str(err)) from None
    return target


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

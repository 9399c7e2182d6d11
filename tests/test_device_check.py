"""experiments/device_check.py: the smoke run writes both reports with every section, the goals table and real
comparisons; the GPU programs compile for an H100 without one; the goals compare in their directions; a budget
overrun cuts a section short and the report keeps what it measured; the comparison fails a kernel whose λ is
negated or whose λ gradient is dropped; the attention timing's ratios are the per-round medians; bad input exits 2."""

import dataclasses
import json
import statistics
import subprocess
import sys

import device_check
import device_report
import jax
import pytest
from bench_attention import diff_candidates
from helpers import REPO, cli_env

from diffjax import kernels
from diffjax.kernels import reference
from diffjax.kernels.conformance import GRAD_NAMES

SCRIPT = REPO / "experiments" / "device_check.py"
GOAL_KEYS = ["attention", "own_standard", "train_step", "mfu", "diff_v2"]


def _run(*args) -> subprocess.CompletedProcess:
    # cli_env: one CPU device, as a user's process (the suite's conftest fakes 8)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_the_goals(tmp_path):
    out = tmp_path / "dc"
    proc = _run("--smoke", "--trace", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    sections, plan = report["sections"], device_check.SMOKE
    assert list(sections) == list(device_check.SECTIONS) and report["passed"] and report["complete"]
    assert report["meta"]["smoke"] and report["meta"]["kernel_platform"] == "gpu"

    att = sections["attention"]  # every GPU candidate, run as a CPU runs its code
    assert att["status"] == "ok" and att["candidates"] == diff_candidates("gpu") and len(att["candidates"]) >= 2
    assert att["standard"] == "cudnn" and att["auto"] == kernels.choice("auto", "diff_attention", "gpu")
    [cell] = att["cells"]
    for name in att["candidates"]:
        assert len(cell[name]["times_s"]) == cell["rounds"] == plan.attention_reps and cell["compile_s"][name] > 0
        assert cell[name]["ratio"]["median"] == pytest.approx(statistics.median(
            a / b for a, b in zip(cell[name]["times_s"], cell["standard"]["times_s"], strict=True)))

    step = sections["train_step"]
    assert step["status"] == "ok" and step["peak_flops"] is None  # a CPU: MFU not guessed
    assert [(r["seq_len"], r["model"]) for r in step["results"]] == [(s, m) for s in plan.train_seqs
                                                                     for m in ("diff", "diff_v2")]
    for r in step["results"]:
        assert set(r["models"]) == {r["model"], "transformer"} and r["rounds"] == plan.train_steps
        for m in r["models"].values():
            assert m["tokens_per_s"] > 0 and m["mfu"] is None and len(m["step_times_s"]) == plan.train_steps
        assert list((out / "trace" / f"T{r['seq_len']}_{r['model']}").rglob("*.xplane.pb")), r  # XProf's trace

    conf = sections["conformance"]
    ran = [r for r in conf["results"] if r["status"] != "skipped"]
    assert conf["status"] == "ok" and ran and all(r["status"] == "passed" for r in ran)
    expected = {("diff_attention", n, d) for d in ("bfloat16", "float32") for n in diff_candidates("gpu", d)}
    assert {(r["op"], r["impl"], r["dtype"]) for r in ran} == expected | {("attention", "cudnn", "bfloat16")}
    for r in ran:  # real comparisons: finite, nonzero errors below the tolerances, every gradient measured
        assert r["emulated"] in ("interpret", "xla") and r["case"]["causal"] and r["case"]["h"] > r["case"]["k"]
        assert 0 < r["errors"]["out"] < r["tolerance"]["forward"], r
        grads = GRAD_NAMES if r["op"] == "diff_attention" else tuple("qkv")
        assert set(r["errors"]) == {"out", *grads}
        # (one gradient can match exactly: dλ is a single float32 sum, which the kernel may round as the reference)
        assert all(0 <= r["errors"][g] < r["tolerance"]["gradients"] for g in grads), r
        assert any(r["errors"][g] > 0 for g in grads), r  # not the oracle compared with itself

    run = sections["training_run"]
    assert run["status"] == "ok" and run["loss_went_down"] and run["last_loss"] < run["first_loss"]
    assert len(run["losses"]) >= 10 and run["steps"] == plan.run_steps

    assert [g["key"] for g in report["goals"]] == GOAL_KEYS
    best = min(cell[n]["ratio"]["median"] for n in att["candidates"])
    [check] = report["goals"][0]["checks"]
    assert check["value"] == pytest.approx(best) and report["goals"][0]["verdict"] == ("met" if best <= 1.25
                                                                                      else "missed")
    md = (out / "device_check.md").read_text()
    headings = ["### Goals", "### Time", "### Attention", "### Train step", "### Kernel conformance",
                "### Training run"]
    assert [md.index(h) for h in headings] == sorted(md.index(h) for h in headings)  # the goals table first
    assert "SMOKE RUN" in md and "--smoke" in md and f"jax {jax.__version__}" in md
    assert all(g["title"] in md for g in report["goals"])


@pytest.mark.slow
def test_compile_only_compiles_every_gpu_program_for_an_h100(tmp_path):
    """The GPU code paths (Triton kernels, cuDNN calls, the training steps on them) compiled for an H100 on this CPU
    host, at the smoke shapes, through the same sections: a typo there fails here, not on device time."""
    out = tmp_path / "dca"
    proc = _run("--smoke", "--compile-only", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    sections = report["sections"]
    assert report["meta"]["compile_only"] and report["meta"]["device"]["kind"].startswith("NVIDIA H100")
    assert all(s["status"] == "ok" and s["compile_s"] > 0 for s in sections.values())
    [cell] = sections["attention"]["cells"]
    own = sections["attention"]["own_standard"]  # the fused kernels' one-map op, beside the standard op
    assert "pallas" in own and set(cell["compile_s"]) == {*diff_candidates("gpu"), "standard",
                                                          *(f"{n} standard" for n in own)} and "times_s" not in cell
    for r in sections["train_step"]["results"]:
        kernels_used = {op: k for m in r["compiled"].values() for op, k in m["kernels"].items()}
        assert kernels_used == {"diff_attention" if r["model"] == "diff" else "attention": "cudnn",
                                "attention": "cudnn"} and r["pair_fits"]
    assert all(r["status"] == "ok" and r["compile_s"] > 0 for r in sections["conformance"]["results"])
    assert all(g["verdict"] == "not measured" for g in report["goals"])
    assert "**COMPILE ONLY** for h100x1" in (out / "device_check.md").read_text()


def _stand_in(monkeypatch):
    """The attention section on CPU with the XLA reference standing in for every kernel (fast to compile)."""
    monkeypatch.setattr(device_check, "diff_candidates", lambda platform, dtype="bfloat16": ["pallas", "cudnn"])
    monkeypatch.setattr(kernels, "choice", lambda impl, op, platform, dtype="bfloat16": "cudnn")
    monkeypatch.setattr(device_check, "runnable", lambda impl, op: (getattr(reference, op), None))


def test_attention_ratios_are_per_round_medians(monkeypatch, tmp_path):
    """The benchmark section's arithmetic: heads from the config, every kernel timed in each round, ratios the
    median of per-round ratios (not a ratio of medians)."""
    _stand_in(monkeypatch)
    plan = device_check.SMOKE
    ctx = device_check.Context(plan, "gpu")
    section = device_check.attention_section(ctx, tmp_path)
    assert section["status"] == "ok", section
    assert section["candidates"] == ["pallas", "cudnn"] and section["standard"] == "cudnn"
    assert (section["diff_heads"], section["standard_heads"], section["head_dim"]) == (2, 4, 16)  # size=tiny
    [cell] = section["cells"]
    assert section["own_standard"] == ["pallas"]  # cudnn's one-map op is the standard itself
    for key in ("pallas", "cudnn", "standard", "pallas standard"):
        assert len(cell[key]["times_s"]) == plan.attention_reps
        assert cell[key]["ms"] == pytest.approx(1e3 * statistics.median(cell[key]["times_s"]))
    paired = [a / b for a, b in zip(cell["pallas"]["times_s"], cell["standard"]["times_s"], strict=True)]
    assert cell["pallas"]["ratio"]["median"] == pytest.approx(statistics.median(paired))
    assert cell["pallas"]["ratio"]["p10"] <= cell["pallas"]["ratio"]["median"] <= cell["pallas"]["ratio"]["p90"]
    t, h, d = cell["seq"], 2, 16
    assert cell["standard"]["tflops"] == pytest.approx(28 * h * t * t * d / 2 / (cell["standard"]["ms"] / 1e3) / 1e12)
    own = [a / b for a, b in zip(cell["pallas standard"]["times_s"], cell["standard"]["times_s"], strict=True)]
    assert cell["pallas standard"]["ratio"]["median"] == pytest.approx(statistics.median(own))
    lines = device_report._attention(section)
    assert any(line.startswith(f"| {t} | {cell['pallas']['ms']:.3f} | {cell['cudnn']['ms']:.3f} | "
                               f"{cell['standard']['ms']:.3f} | {cell['pallas standard']['ms']:.3f} |")
               for line in lines)
    [check] = device_report._own_standard_checks({"attention": section}, plan)
    assert check.value == cell["pallas standard"]["ratio"]["median"]


def test_every_mosaic_gpu_tile_set_of_both_head_classes_is_checked_and_one_that_fails_fails_the_section(
        monkeypatch, tmp_path):
    """The section's head class's tile sets are checked, then timed; the other class's are checked only (d ≤ 64's
    fused dQ runs on the hardware before anything chooses it); a set that fails the reference is not timed, and it
    fails the section and is named in the report."""
    from diffjax.kernels import mosaic_gpu

    _stand_in(monkeypatch)
    monkeypatch.setattr(device_check, "diff_candidates", lambda platform, dtype="bfloat16": ["cudnn", "mosaic_gpu"])
    broken = mosaic_gpu.candidates(128)["rows"]

    def stand_in(impl, op):  # the reference, with a wrong λ gradient under the broken tile set
        def fn(*args, block_sizes=None, **kw):
            out, lam = reference.diff_attention(*args, **kw), args[5]
            return out if block_sizes != broken else out + 0.5 * (lam - jax.lax.stop_gradient(lam)).sum()
        return (fn if op == "diff_attention" else getattr(reference, op)), None
    monkeypatch.setattr(device_check, "runnable", stand_in)
    section = device_check.attention_section(device_check.Context(device_check.SMOKE, "gpu"), tmp_path)
    assert section["head_dim"] == 16 and section["status"] == "failed"
    checked = section["tile_conformance"]
    other = [f"{n} (d = 128)" for n in mosaic_gpu.candidates(128)]
    assert sorted(checked) == sorted([*mosaic_gpu.candidates(16), *other])
    assert {name for name, e in checked.items() if e["status"] != "passed"} == {"rows (d = 128)"}
    assert section["candidates"] == ["cudnn", *(f"mosaic_gpu {n}" for n in mosaic_gpu.candidates(16))]  # d = 16's timed
    [cell] = section["cells"]
    assert cell["status"] == "ok" and "mosaic_gpu rows" in cell
    [line] = [x for x in device_report._attention(section) if x.startswith("Mosaic GPU tile sets")]
    assert "`rows (d = 128)` failed (" in line and "`maps (d = 128)` passed (" in line


def test_the_train_step_times_diff_on_the_mosaic_gpu_kernel_where_the_platform_has_it(monkeypatch):
    """Each T: DIFF on "auto", DIFF on `mosaic_gpu` (its step's ratio is what the kernel is for), DIFF V2, each
    against the Transformer; without the kernel, the first and last only."""
    timed = []
    monkeypatch.setattr(device_check, "_build", lambda ctx, arch, cfg, base=None: arch)
    monkeypatch.setattr(device_check, "_time_pair", lambda ctx, arch, cfg, base, peak: timed.append(
        (cfg.data.seq_len, arch, cfg.model.arch, cfg.model.attention_impl)) or dict(status="ok"))
    monkeypatch.setattr(device_check.metrics_lib, "peak_flops_per_device", lambda device: None)
    plan = dataclasses.replace(device_check.SMOKE, train_seqs=(64, 128))
    for have in (True, False):
        timed.clear()
        monkeypatch.setattr(device_check, "diff_candidates",
                            lambda platform, dtype="bfloat16", have=have: ["cudnn", *["mosaic_gpu"] * have])
        section = device_check.train_step_section(device_check.Context(plan, "gpu"))
        mosaic = [("diff_mosaic_gpu", "diff", "mosaic_gpu")] if have else []
        assert timed == [(t, *unit) for t in (64, 128) for unit in [("diff", "diff", "auto"), *mosaic,
                                                                     ("diff_v2", "diff_v2", "auto")]]
        assert section["status"] == "ok" and section["models"] == [unit[1] for unit in timed[:len(timed) // 2]]


def _sections(rng, plan, drop_seq=None) -> dict:
    """Attention cells and train-step pairs with random ratios and MFUs around the goals' targets."""
    ratio = lambda lo, hi: dict(median=float(rng.uniform(lo, hi)), p10=0.0, p90=9.0)  # noqa: E731
    cells = [{"seq": s, "status": "ok", "standard": {"ms": 1.0}, "pallas": dict(ratio=ratio(0.9, 1.6)),
              "cudnn": dict(ratio=ratio(0.9, 1.6)), "pallas standard": dict(ratio=ratio(0.95, 1.2))}
             for s in plan.attention_seqs if s != drop_seq]
    results = [dict(seq_len=s, model=m, status="ok", ratio=ratio(0.95, 1.2),
                    models={m: dict(mfu=float(rng.uniform(0.3, 0.6))), "transformer": dict(mfu=float(
                        rng.uniform(0.3, 0.6)))}) for s in plan.train_seqs for m in ("diff", "diff_v2")]
    return {"attention": dict(status="ok", candidates=["pallas", "cudnn"], auto="cudnn", own_standard=["pallas"],
                              cells=cells),
            "train_step": dict(status="ok", results=results)}


def test_goals_compare_each_value_in_its_direction(rng):
    plan = device_check.FULL
    for _ in range(20):
        sections = _sections(rng, plan)
        cells, results = sections["attention"]["cells"], sections["train_step"]["results"]
        pair = {(r["seq_len"], r["model"]): r for r in results}
        best = [min(c["pallas"]["ratio"]["median"], c["cudnn"]["ratio"]["median"]) for c in cells]
        at_2k = pair[(2048, "diff")]["models"]
        expected = {"attention": all(b <= 1.25 for b in best),
                    "own_standard": all(c["pallas standard"]["ratio"]["median"] <= 1.10 for c in cells),
                    "train_step": all(pair[(s, "diff")]["ratio"]["median"] <= 1.10 for s in (2048, 4096)),
                    "mfu": at_2k["transformer"]["mfu"] >= 0.45 and at_2k["diff"]["mfu"] >= 0.42,
                    "diff_v2": all(pair[(s, "diff_v2")]["ratio"]["median"] <= 1.05 for s in (2048, 4096))}
        rows = {g["key"]: g for g in device_report.goals(sections, plan)}
        assert {k: g["verdict"] for k, g in rows.items()} == {k: "met" if v else "missed"
                                                              for k, v in expected.items()}
        assert [c["value"] for c in rows["attention"]["checks"]] == best
        assert [c["value"] for c in rows["mfu"]["checks"]] == [at_2k["transformer"]["mfu"], at_2k["diff"]["mfu"]]
    # a length not measured: "not measured" unless a measured one already misses
    sections = _sections(rng, plan, drop_seq=8192)
    [row] = [g for g in device_report.goals(sections, plan) if g["key"] == "attention"]
    measured = [c["value"] for c in row["checks"] if c["value"] is not None]
    assert len(measured) == 2 and row["verdict"] == ("missed" if max(measured) > 1.25 else "not measured")
    assert all(g["verdict"] == "not measured" for g in device_report.goals({}, plan))


def test_the_budget_splits_by_shares_and_passes_unused_time_on(rng, tmp_path, monkeypatch):
    """Each section's deadline: its share of the time left among itself and those after it; a unit starts only while
    the deadline leaves the time the last one took."""
    now = [float(rng.uniform(0, 1e6))]
    monkeypatch.setattr(device_check, "clock", lambda: now[0])
    used = {"attention": 0.05, "train_step": 0.7, "conformance": 0.0}  # of the budget; the training run is checked
    seen = []

    def section(name):
        def runner(ctx, out):
            seen.append(ctx.deadline - now[0])
            now[0] += used.get(name, 0.0) * total
            return dict(status="ok")
        return runner

    total = float(rng.uniform(100, 1000))
    for name in device_check.SECTIONS:
        monkeypatch.setitem(device_check.RUNNERS, name, section(name))
    device_check.run(list(device_check.SECTIONS), device_check.SMOKE, tmp_path, "cmd", total, smoke=True)
    # attention: 15 % of all; it used 5 %: train step 55/85 of the 95 % left; it overran: conformance gets
    # 15/30 of what is left of the whole (25 %); it used none: the training run, last, gets all 25 %
    assert seen == pytest.approx([0.15 * total, 0.95 * total * 55 / 85, 0.25 * total * 15 / 30, 0.25 * total])
    # units: each estimated as the last took; the first runs on its estimate
    ctx = device_check.Context(device_check.SMOKE, "gpu", deadline=now[0] + 10)
    done = []
    for unit in ctx.units(["u1", "u2", "u3"]):
        done.append(unit)
        now[0] += 6  # u1 takes 6 s: u2 (estimated 6 s) does not fit the 4 s left
    assert done == ["u1"] and (ctx.cut["done"], ctx.cut["of"], ctx.cut["next"]) == (1, 3, "u2")
    assert (ctx.cut["left_s"], ctx.cut["needed_s"]) == (pytest.approx(4), pytest.approx(6))
    assert list(device_check.Context(device_check.SMOKE, "gpu", deadline=now[0] + 10).units(["x"], 11)) == []


def test_a_budget_overrun_cuts_a_section_and_the_report_keeps_what_it_measured(tmp_path, monkeypatch):
    """The clock jumps past the budget once the first attention length is saved: the next length is not started,
    the section is reported cut with the first length's figures, and that report is on disk before the next
    section starts (which here stops the run, as a kill would)."""
    _stand_in(monkeypatch)
    now = [0.0]
    monkeypatch.setattr(device_check, "clock", lambda: now[0])
    written = device_report.write_report

    def write_then_jump(out, report):
        written(out, report)
        if report["sections"].get("attention", {}).get("cells"):
            now[0] = 1e9

    def killed(ctx, out):
        raise KeyboardInterrupt

    monkeypatch.setattr(device_check, "write_report", write_then_jump)
    monkeypatch.setitem(device_check.RUNNERS, "train_step", killed)
    plan = dataclasses.replace(device_check.SMOKE, attention_seqs=(32, 64))
    with pytest.raises(KeyboardInterrupt):
        device_check.run(list(device_check.SECTIONS), plan, tmp_path, "cmd", 300.0, smoke=True)
    report = json.loads((tmp_path / "device_check.json").read_text())
    att = report["sections"]["attention"]
    assert att["status"] == "cut" and [c["seq"] for c in att["cells"]] == [32]
    assert att["cut"]["done"] == 1 and att["cut"]["next"] == "T = 64" and att["cells"][0]["pallas"]["ratio"]
    assert report["passed"] and not report["complete"]
    [check_32, check_64] = report["goals"][0]["checks"]
    assert check_32["value"] is not None and check_64["value"] is None
    md = (tmp_path / "device_check.md").read_text()
    assert "Cut short by the time budget: 1 of 2 units done; the next (T = 64)" in md and "### Goals" in md


def test_the_comparison_fails_a_negated_lambda_and_a_dropped_lambda_gradient():
    """The check of the script on the reference, with λ's sign flipped (the forward is wrong) and with λ's gradient
    cut (only a gradient is wrong)."""
    case = device_check.SMOKE.cases[-1]  # float32, segment ids
    assert device_check.check_entry("diff_attention", "xla", reference.diff_attention, case)["status"] == "passed"
    for name, mutate in [("negated", lambda lam: -lam), ("no dλ", jax.lax.stop_gradient)]:
        def mutated(q1, q2, k1, k2, v, lam, mutate=mutate, **kw):
            return reference.diff_attention(q1, q2, k1, k2, v, mutate(lam), **kw)

        entry = device_check.check_entry("diff_attention", "xla", mutated, case)
        assert entry["status"] == "failed" and not entry["passed"], (name, entry)
        assert entry["errors"]["lam"] > entry["tolerance"]["gradients"], name
    assert entry["errors"]["out"] < 1e-6  # the forward untouched: the gradient alone failed it


def test_bad_input_exits_2(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("")
    cases = [(["--smoke", "--out", afile], "device_check: --out"),
             (["--out", tmp_path / "x"], "no GPU or TPU"),  # no --smoke on a CPU
             (["--smoke", "--budget-s", "0", "--out", tmp_path / "x"], "--budget-s must be > 0"),
             (["--smoke", "--target", "h100x1", "--out", tmp_path / "x"], "--target: only with --compile-only"),
             (["--compile-only", "--target", "h200x3", "--out", tmp_path / "x"], "unknown target 'h200x3'"),
             (["--smoke", "--train-set", "diff:model.remat=sometimes", "--out", tmp_path / "x"], "model.remat")]
    for args, message in cases:
        assert device_check.main(list(map(str, args))) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("device_check: ") and message in err[0], (args, err)
    assert not (tmp_path / "x").exists()


def test_train_set_overrides_every_model_or_one_arch():
    """`--train-set KEY=VALUE` goes to every train-step model (the baseline too: a fair pair), `ARCH:KEY=VALUE` to
    that arch's alone; a colon in a value is the value's."""
    overrides = ["model.remat=attention", "diff:model.attention_impl=cudnn_wide_v", "data.path=/a:b",
                 "diff_v2:model.dtype=float32"]
    assert device_check.overrides_for("diff", overrides) == ["model.remat=attention",
                                                             "model.attention_impl=cudnn_wide_v", "data.path=/a:b"]
    assert device_check.overrides_for("transformer", overrides) == ["model.remat=attention", "data.path=/a:b"]
    assert device_check.overrides_for("diff_v2", overrides) == ["model.remat=attention", "data.path=/a:b",
                                                                "model.dtype=float32"]


def test_the_fastest_mosaic_gpu_tiles_become_the_table_get_default_reads(monkeypatch, tmp_path):
    """`tune`: of the timed tile candidates, the lowest geometric mean over T of time / cuDNN's composition's is written
    (from a GPU's times only) in the format `mosaic_gpu.BlockSizes.get_default` and "auto" read."""
    from diffjax.kernels import mosaic_gpu

    def cell(seq, cudnn, rows, maps):
        return {"seq": seq, "status": "ok", "cudnn": {"ms": cudnn}, "mosaic_gpu rows": {"ms": rows},
                "mosaic_gpu maps": {"ms": maps}, "mosaic_gpu standard": {"ms": 0.1}}

    # rows: 0.5 then 2.0 (geometric mean 1.0); maps: 0.9 both times (0.9): maps wins, though rows is faster at 2K
    result = {"cells": [cell(2048, 1.0, 0.5, 0.9), cell(4096, 4.0, 8.0, 3.6)]}
    assert device_check.tune(result, 128, tmp_path)["tiles"] == "maps"
    assert not (tmp_path / mosaic_gpu.TUNED.name).exists()  # timed on a CPU: no table
    monkeypatch.setattr(device_check.jax, "default_backend", lambda: "gpu")
    entry = device_check.tune(result, 128, tmp_path)
    assert entry["vs_cudnn"] == pytest.approx(0.9) and entry["candidates_vs_cudnn"]["rows"] == pytest.approx(1.0)
    monkeypatch.setattr(mosaic_gpu, "TUNED", tmp_path / mosaic_gpu.TUNED.name)
    mosaic_gpu._tuned_table.cache_clear()
    try:
        assert mosaic_gpu.BlockSizes.get_default(128) == mosaic_gpu.candidates(128)["maps"]
        assert mosaic_gpu.measured_faster()
    finally:
        mosaic_gpu._tuned_table.cache_clear()

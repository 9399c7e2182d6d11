"""experiments/device_check.py: the smoke run writes both reports with every section and real comparisons; the
comparison fails a kernel whose λ is negated or whose λ gradient is dropped; the attention timing's ratios are the
per-round medians; bad input exits 2."""

import json
import statistics
import subprocess
import sys

import jax
import pytest
from helpers import REPO, cli_env

from diffjax import kernels
from diffjax.bench import device_check
from diffjax.kernels import reference
from diffjax.kernels.conformance import GRAD_NAMES

SCRIPT = REPO / "experiments" / "device_check.py"


def _run(*args) -> subprocess.CompletedProcess:
    # cli_env: one CPU device, as a user's process (the suite's conftest fakes 8)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "dc"
    proc = _run("--smoke", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(device_check.SECTIONS) and report["passed"] and report["meta"]["smoke"]

    conf = sections["conformance"]
    ran = [r for r in conf["results"] if r["status"] != "skipped"]
    assert conf["status"] == "ok" and ran and all(r["status"] == "passed" for r in ran)
    assert {(r["dtype"], r["case"]["segments"]) for r in ran} == {(d, s) for d in ("bfloat16", "float32")
                                                                  for s in (False, True)}
    for r in ran:  # real comparisons: finite, nonzero errors below the tolerances, every gradient measured
        assert r["impl"] == "pallas_gpu" and r["interpret"] and r["case"]["causal"] and r["case"]["h"] > r["case"]["k"]
        assert set(r["errors"]) == {"out", *GRAD_NAMES}
        assert 0 < r["errors"]["out"] < r["tolerance"]["forward"], r
        # (one gradient can match exactly: dλ is a single float32 sum, which the kernel may round as the reference)
        assert all(0 <= r["errors"][g] < r["tolerance"]["gradients"] for g in GRAD_NAMES), r
        assert any(r["errors"][g] > 0 for g in GRAD_NAMES), r  # not the oracle compared with itself
    assert conf["skipped"] and all("oracle itself" in s["reason"] for s in conf["skipped"])

    assert sections["attention"]["status"] == "skipped" and "cuDNN needs a GPU" in sections["attention"]["reason"]

    step = sections["train_step"]
    assert step["status"] == "ok" and step["peak_flops"] is None  # a CPU: MFU not guessed
    for result in step["results"]:
        assert set(result["models"]) == {"diff", "transformer"}
        for m in result["models"].values():
            assert m["tokens_per_s"] > 0 and m["mfu"] is None and len(m["step_times_s"]) == step["steps"]

    run = sections["training_run"]
    assert run["status"] == "ok" and run["loss_went_down"] and run["last_loss"] < run["first_loss"]
    assert len(run["losses"]) >= 10 and run["steps"] == device_check.SMOKE.run_steps

    md = (out / "device_check.md").read_text()
    for heading in ("## Device check", "### Kernel conformance", "### Attention", "### Train step",
                    "### Training run"):
        assert heading in md
    assert "SMOKE RUN" in md and "--smoke" in md and f"jax {jax.__version__}" in md
    assert "Skipped: no fused attention kernels on cpu" in md
    assert md.count("| pallas_gpu (interpret) | diff_attention |") == len(ran)


def test_the_comparison_fails_a_negated_lambda_and_a_dropped_lambda_gradient(monkeypatch):
    """The check of the script, on the kernel the registry serves, with λ's sign flipped (the forward is wrong) and
    with λ's gradient cut (only a gradient is wrong)."""
    case = device_check.SMOKE.cases[-1]  # float32, segment ids
    assert device_check.check_target("diff_attention", "xla", True, case, "cpu")["status"] == "passed"
    original = kernels.diff_attention
    for name, mutate in [("negated", lambda lam: -lam), ("no dλ", jax.lax.stop_gradient)]:
        monkeypatch.setattr(kernels, "diff_attention", lambda q1, q2, k1, k2, v, lam, mutate=mutate, **kw:
                            original(q1, q2, k1, k2, v, mutate(lam), **kw))
        entry = device_check.check_target("diff_attention", "xla", True, case, "cpu")
        assert entry["status"] == "failed" and not entry["passed"], (name, entry)
        assert entry["errors"]["lam"] > entry["tolerance"]["gradients"], name
    assert entry["errors"]["out"] < 1e-6  # the forward untouched: the gradient alone failed it


def test_attention_ratios_are_per_round_medians(monkeypatch):
    """The benchmark section's arithmetic on CPU, with the XLA reference standing in for every kernel: heads from the
    config, every kernel timed in each round, ratios the median of per-round ratios (not a ratio of medians)."""
    monkeypatch.setattr(kernels, "candidates", lambda op, platform, dtype: ["pallas", "cudnn", "xla"])
    monkeypatch.setattr(kernels, "choice", lambda impl, op, platform, dtype: "cudnn")
    monkeypatch.setattr(kernels, "resolve", lambda impl, op, **kw: getattr(reference, op))
    plan = device_check.SMOKE
    section = device_check.attention_section(plan, "gpu")
    assert section["status"] == "ok", section
    assert section["impls"] == {"diff": "pallas", "fallback": "cudnn", "standard": "cudnn"}
    assert (section["diff_heads"], section["standard_heads"], section["head_dim"]) == (2, 4, 16)  # size=tiny
    [cell] = section["cells"]
    for key in ("diff", "fallback", "standard"):
        assert len(cell[key]["times_s"]) == plan.attention_reps
        assert cell[key]["ms"] == pytest.approx(1e3 * statistics.median(cell[key]["times_s"]))
    paired = [a / b for a, b in zip(cell["diff"]["times_s"], cell["standard"]["times_s"], strict=True)]
    assert cell["ratio"]["median"] == pytest.approx(statistics.median(paired))
    assert cell["ratio"]["p10"] <= cell["ratio"]["median"] <= cell["ratio"]["p90"]
    t, h, d = cell["seq"], 2, 16
    assert cell["standard"]["tflops"] == pytest.approx(28 * h * t * t * d / 2 / (cell["standard"]["ms"] / 1e3) / 1e12)
    md = device_check.markdown(dict(meta=dict(device=dict(kind="x", platform="gpu", count=1, cpu="c"), smoke=True,
                                              command="c", started="s", wall_s=1.0, versions={}),
                                    passed=True, sections={"attention": section}))
    assert f"| {t} | {cell['diff']['ms']:.3f} | {cell['fallback']['ms']:.3f} | {cell['standard']['ms']:.3f} |" in md


def test_bad_input_exits_2(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("")
    proc = _run("--smoke", "--out", afile)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("device_check: --out")
    proc = _run("--out", tmp_path / "x")  # no --smoke on a CPU
    assert proc.returncode == 2 and "no GPU or TPU" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()

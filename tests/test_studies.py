"""The study drivers end to end on a handful of steps (Table 6 ablation, Fig. 3 scaling), and the scaling fit
recovering known parameters from synthetic points."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, cli_env

from diffjax import eval as eval_lib
from diffjax import sweep as sweep_lib
from diffjax.config import ConfigError
from diffjax.model import archs, param_count
from diffjax.studies import ablation, scaling

sys.path.insert(0, str(REPO / "experiments"))
import quantization_study  # noqa: E402  (a script of experiments/, as a user runs it)

TINY = ["model.n_layers=1", "data.seq_len=64", "data.batch_size=8", "train.steps=3", "train.eval_every=3",
        "train.checkpoint_every=3", "train.eval_batches=1", "train.log_every=1"]


@pytest.fixture
def corpus(tmp_path, rng):
    words = ["".join(rng.choice(list("abcdefgh"), rng.integers(1, 6))) for _ in range(60)]
    paragraphs = [" ".join(rng.choice(words, rng.integers(20, 60))) for _ in range(40)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs))
    return path


@pytest.mark.slow
def test_ablation_driver_writes_table_6(tmp_path, corpus, monkeypatch):
    """Two of Table 6's rows end to end, each its own sweep, joined in one report (all seven rows, from their
    configs: the next test)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    sweep, later = tmp_path / "ablation", tmp_path / "diff"
    assert ablation.run_sweep(str(corpus), sweep_dir=sweep, seeds=2, rows="transformer", overrides=TINY) == sweep
    assert ablation.run_sweep(str(corpus), sweep_dir=later, seeds=2, rows="diff", overrides=TINY) == later
    other = tmp_path / "other-recipe"  # the same row trained for longer: not pairable with these
    shutil.copytree(later, other, ignore=shutil.ignore_patterns("checkpoints", "state"))
    for member in (other / "members").iterdir():
        config = json.loads((member / "config.json").read_text())
        config["train"]["steps"] = 4
        (member / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="another recipe"):
        ablation.report(sweep, batches=1, joined=(other,))
    with pytest.raises(ConfigError, match=r"rows trained twice across the sweeps: \[\('diff', 0\), \('diff', 1\)\]"):
        ablation.report(sweep, batches=1, joined=(later, later))
    ablation.report(sweep, batches=1, joined=(later,))
    lines = (sweep / "ablation.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| Model"))
    assert [c.strip() for c in header.split("|")[1:-1]] == ["Model", "#heads", "d", "GN", "Valid. loss", "AR-Hit",
                                                            "Others", "seeds"]
    table = lines[lines.index(header):]
    table = table[:table.index("")] if "" in table else table  # Table 6 itself, not the paired table below it
    body = [line for line in table if line.startswith("| ") and not line.startswith(("| Model", "|---"))]
    assert [[c.strip() for c in row.split("|")[1:5]] for row in body] == [["Transformer", "4", "32", "✗"],
                                                                          ["DIFF Transformer", "2", "32", "✓"]]
    assert all(row.split("|")[8].strip() == "2/2" and "±" in row.split("|")[5] for row in body)
    with open(sweep / "ablation.csv") as f:
        per_seed = list(csv.DictReader(f))
    assert len(per_seed) == 4
    for r in per_seed:  # each row's loss is its own member's, recomputed here: float64 cross-entropy of its logits
        if r["seed"] == "0" and r["variant"] in ("transformer", "diff"):
            assert float(r["loss"]) == pytest.approx(_validation_loss(Path(r["run"])), rel=1e-5)
    for row, variant in zip(body, ["transformer", "diff"], strict=True):  # mean ± std over seeds
        losses = [float(r["loss"]) for r in per_seed if r["variant"] == variant]
        assert row.split("|")[5].strip() == f"{np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f}"
    loss = {(r["variant"], r["seed"]): float(r["loss"]) for r in per_seed}  # and the paired difference
    differences = [loss["transformer", s] - loss["diff", s] for s in ("0", "1")]
    assert (f"| Transformer (transformer) | 2 | {differences[0]:+.4f}, {differences[1]:+.4f} | "
            f"{np.mean(differences):+.4f} |") in "\n".join(lines)


def test_table_6_has_the_papers_seven_rows_in_order_with_their_heads_d_and_group_norm(rng):
    """configs/ablation.py's members, as `ablation.evaluate` describes them, through `ablation.table`."""
    sweep = sweep_lib.load("configs/ablation.py:seeds=2,data=corpus.txt")
    rows = [{"variant": m.variant, "seed": m.seed, "heads": m.config.model.n_heads,
             "head_dim": m.config.model.head_dim, "gn": archs.uses_headwise_norm(m.config.model), "diverged": False,
             **{key: float(rng.uniform(1, 3)) for key, _ in ablation.COLUMNS}} for m in sweep.members]
    body = [line for line in ablation.table(rows).splitlines()[2:]]
    assert [[c.strip() for c in row.split("|")[1:5]] for row in body] == [
        ["Transformer", "4", "32", "✗"], ["Transformer", "2", "64", "✗"], ["+ GroupNorm", "2", "64", "✓"],
        ["DIFF Transformer", "2", "32", "✓"], ["− GroupNorm", "2", "32", "✗"], ["with λ_init = 0.8", "2", "32", "✓"],
        ["with λ_init = 0.5", "2", "32", "✓"]]
    for row, variant in zip(body, ablation.ROWS, strict=False):  # Table 6's order is ROWS' order
        losses = [r["loss"] for r in rows if r["variant"] == variant]
        assert row.split("|")[5].strip() == f"{np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f}"
        assert row.split("|")[8].strip() == "2/2"


def _validation_loss(run, batches: int = 1) -> float:
    from diffjax.data.pipeline import validation_iterator
    from diffjax.model import DecoderLM
    from diffjax.train.run_loader import load_run

    cfg, state, _ = load_run(run)
    data, total, count = validation_iterator(cfg.data), 0.0, 0.0
    for _ in range(batches):
        b = data.next()
        logits = np.asarray(DecoderLM(cfg.model).apply({"params": state.params}, b["tokens"], b["positions"],
                                                       b["segment_ids"]), np.float64)
        top = logits.max(-1, keepdims=True)
        nll = np.log(np.exp(logits - top).sum(-1)) + top[..., 0] - np.take_along_axis(
            logits, b["targets"][..., None].astype(int), -1)[..., 0]
        total, count = total + float((nll * b["loss_mask"]).sum()), count + float(b["loss_mask"].sum())
    data.close()
    return total / count


def _within_three_sigma(comparison: dict, expected: float) -> bool:
    """The fitted matching fraction is within 3σ of the truth in log space, σ = half the log-width of the bootstrap's
    16–84 % interval. Extrapolating beyond the largest point (gated needs ~190 %) widens the error, so a fixed
    absolute tolerance flakes; 300 noise draws gave |z| ≤ 2.0 for both archs (max 1.98)."""
    sigma = (np.log(comparison["fraction_84"]) - np.log(comparison["fraction_16"])) / 2
    return abs(np.log(comparison["fraction"] / expected)) <= 3 * sigma


def test_scaling_fit_recovers_known_parameters(rng):
    x = np.geomspace(1e5, 3e7, 7)
    truth = {"diff": (1.70, 30.0, 0.28), "transformer": (1.76, 30.0, 0.28), "gated": (1.80, 30.0, 0.28)}
    points = {arch: {float(n): list(scaling.power_law(n, *p) + rng.normal(0, 2e-3, 4)) for n in x}
              for arch, p in truth.items()}
    result = scaling.analyse(points, resamples=200)
    for arch, (e, _, alpha) in truth.items():
        fe, _, falpha = result["fits"][arch]
        assert abs(fe - e) < 0.05 and abs(falpha - alpha) / alpha < 0.15, (arch, result["fits"][arch])
    expected = scaling.matching_fraction(truth["diff"], truth["transformer"], x.max())
    assert _within_three_sigma(result, expected), (result["fraction"], expected)
    assert "DIFF matches" in result["headline"]
    # every other arch against the Transformer too (gated is behind it: it needs more than 100 % to match)
    gated = result["comparisons"]["gated"]
    expected = scaling.matching_fraction(truth["gated"], truth["transformer"], x.max())
    assert expected > 1 and _within_three_sigma(gated, expected), (gated["fraction"], expected)
    assert gated["headline"].startswith("gated matches") and "- gated matches" in scaling.markdown({"size": result})
    # identical archs: the fit must not claim a difference
    same = scaling.analyse({"diff": points["transformer"], "transformer": points["transformer"]}, resamples=200)
    assert "cannot tell" in same["headline"] or "no difference" in same["headline"]


@pytest.mark.slow
def test_scaling_driver_end_to_end(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    from diffjax import cli

    # (the scaling report reads no telemetry: test_telemetry and the ablation driver cover it)
    common = [a for s in [*TINY[1:], "train.telemetry_every=0"] for a in ("--set", s)]
    for study, extra in (("size", ",sizes=xs+s+m"), ("tokens", "")):  # three sizes: the fewest a fit takes
        assert cli.main(["sweep", "--config", f"configs/scaling.py:study={study},scale=cpu,data={corpus},seeds=1"
                         + extra, "--workdir", str(tmp_path / study), "--no-progress", *common]) == 0
    scaling.report(tmp_path / "size", tmp_path / "tokens", tmp_path / "out")
    md = (tmp_path / "out" / "scaling.md").read_text()
    assert "## parameters" in md and "## training tokens" in md
    points_table = md.split("## training tokens")[0].split("| arch | parameters |")[1]  # after the fit table
    sizes = [float(line.split("|")[2]) for line in points_table.splitlines() if line.startswith("| diff | ")]
    assert len(sizes) == 3 and sizes == sorted(sizes)
    paired_lines = [line for line in md.split("## training tokens")[0].splitlines() if line.startswith("| xs | diff |")]
    assert len(paired_lines) == 1 and paired_lines[0].split("|")[3].strip() == "1"  # one seed: n = 1
    from diffjax import sweep as sweep_lib
    from diffjax.model import param_count

    full = sweep_lib.load(f"configs/scaling.py:study=size,scale=cpu,data={corpus},seeds=1")  # the whole study:
    counts = [param_count(m.config.model)["params"] for m in full.members if m.config.model.arch == "diff"]
    assert len(counts) == 4 and max(counts) / min(counts) > 10  # four CPU sizes spanning > 10× in parameters
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 0


def test_ablation_config_trains_the_named_rows_in_table_order():
    sweep = sweep_lib.load("configs/ablation.py:seeds=2,data=corpus.txt,rows=diff-gn+transformer,baselines=sink")
    assert [m.name for m in sweep.members] == ["transformer__seed0", "transformer__seed1", "diff-gn__seed0",
                                               "diff-gn__seed1", "sink__seed0", "sink__seed1"]
    assert {m.variant: m.config.model.headwise_norm for m in sweep.members}["diff-gn"] is False
    everything = sweep_lib.load("configs/ablation.py:seeds=1,data=corpus.txt")
    assert len({m.variant for m in everything.members}) == 7
    # the split head layout (microsoft/unilm #1663): the Transformer's 2h heads, each of d/2, as many parameters
    layouts = {m.variant: m.config.model for m in
               sweep_lib.load("configs/ablation.py:seeds=1,data=corpus.txt,rows=diff+diff-split").members}
    diff, split = layouts["diff"], layouts["diff-split"]
    assert (split.arch, split.n_heads, split.head_dim) == ("diff", 2 * diff.n_heads, diff.head_dim // 2)
    assert abs(param_count(split)["params"] / param_count(diff)["params"] - 1) < 1e-3
    with pytest.raises(ConfigError, match=r"rows: unknown \['dif'\]; choose from transformer\+"):
        sweep_lib.load("configs/ablation.py:data=corpus.txt,rows=dif+transformer")


def test_scaling_config_takes_any_arch_list_matched_to_diff():
    sweep = sweep_lib.load("configs/scaling.py:study=size,data=corpus.txt,seeds=1,sizes=xs+l,archs=diff+sink+gated")
    models = {m.variant: m.config.model for m in sweep.members}
    assert list(models) == ["xs-diff", "xs-sink", "xs-gated", "l-diff", "l-sink", "l-gated"]
    for size in ("xs", "l"):
        diff = param_count(models[f"{size}-diff"])["params"]
        for arch in ("sink", "gated"):
            assert models[f"{size}-{arch}"].arch == arch
            assert abs(param_count(models[f"{size}-{arch}"])["params"] / diff - 1) < 0.01, (size, arch)
    with pytest.raises(ConfigError, match=r"archs: unknown \['difff'\]"):
        sweep_lib.load("configs/scaling.py:data=corpus.txt,archs=difff+transformer")


def test_scaling_pairs_each_arch_with_the_transformer_at_each_point():
    finals = {"xs": {"diff": {0: 2.0, 1: 2.2, 2: 2.1}, "transformer": {0: 2.1, 1: 2.4, 2: 2.0},
                     "sink": {0: 2.3, 2: 2.2}},
              "l": {"diff": {0: 1.5, 1: 1.6}, "transformer": {0: 1.7, 1: 1.9}}}
    rows = {(r["point"], r["arch"]): r for r in scaling.paired_rows(finals)}
    assert sorted(rows) == [("l", "diff"), ("xs", "diff"), ("xs", "sink")]
    assert rows[("xs", "diff")]["n"] == 3 and rows[("xs", "diff")]["mean"] == pytest.approx(-0.2 / 3)
    assert rows[("xs", "sink")]["n"] == 2 and rows[("xs", "sink")]["mean"] == pytest.approx(0.2)  # seeds 0 and 2
    assert rows[("l", "diff")]["mean"] == pytest.approx(-0.25)
    # by hand: differences −0.1, −0.2, +0.1; sd = 0.152753, t = −0.755929; with 2 degrees of freedom the two-sided
    # p is 1 − |t| / √(t² + 2) = 0.528595
    assert rows[("xs", "diff")]["p"] == pytest.approx(0.528595, abs=1e-4)
    assert rows[("xs", "diff")]["per_seed"] == pytest.approx([-0.1, -0.2, 0.1])
    assert rows[("xs", "diff")]["reading"] == "no detectable difference at n = 3"


def test_ablation_along_training_pairs_each_validation_step_and_summarises_telemetry(tmp_path, rng):
    """Hand-written metrics of two rows × two seeds: the paired difference at every validation step and the
    telemetry means are recomputed here from the planted numbers."""
    losses, rms = {}, {}
    rows = []
    for variant in ("transformer", "diff"):
        for seed in (0, 1):
            member = f"{variant}__seed{seed}"
            losses[member] = {step: float(rng.uniform(1, 3)) for step in (200, 400)}
            rms[member] = {step: rng.uniform(0.1, 1, 2).tolist() for step in (50, 100, 150, 400)}  # 2 layers
            records = [{"step": s, "split": "val", "loss": v} for s, v in losses[member].items()]
            records += [{"step": s, "split": "telemetry", "head_rms": v} for s, v in rms[member].items()]
            records += [{"step": 120, "split": "train", "grad_norm_attn": [1.0, 3.0 + seed]}]
            (tmp_path / "members" / member).mkdir(parents=True)
            (tmp_path / "members" / member / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
            rows.append({"member": member, "variant": variant, "seed": seed})
    md = ablation.along_training(tmp_path, rows)
    for step in (200, 400):
        d = [losses[f"diff__seed{s}"][step] - losses[f"transformer__seed{s}"][step] for s in (0, 1)]
        assert f"| {step} | DIFF Transformer (diff) | 2 | {d[0]:+.4f}, {d[1]:+.4f} | {np.mean(d):+.4f} |" in md
    assert [int(line.split("|")[1]) for line in md.splitlines() if "(diff) |" in line and "±" in line] == [50, 100,
                                                                                                       400]
    # step 150 is not a milestone (< 2 × 100); step 100's diff row: its head RMS, and the grad norm logged at 120
    # is not yet there (nan: "—")
    means = [np.mean(rms[f"diff__seed{s}"][100]) for s in (0, 1)]
    row = next(line for line in md.splitlines() if line.startswith("| 100 | DIFF Transformer (diff) |"))
    assert row.split("|")[3].strip() == f"{np.mean(means):.3f} ± {np.std(means, ddof=1):.3f}"
    assert row.split("|")[5].strip() == "—"
    row = next(line for line in md.splitlines() if line.startswith("| 400 | Transformer (transformer) |"))
    assert row.split("|")[5].strip() == f"{np.mean([2.0, 2.5]):.3f} ± {np.std([2.0, 2.5], ddof=1):.3f}"
    # a member that has not reached a step yet (a running sweep) gives no number there, not its last one
    (tmp_path / "members" / "diff__seed1" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "split": "telemetry", "head_rms": v}) for s, v in rms["diff__seed1"].items()
                  if s < 400))
    row = [line for line in ablation.along_training(tmp_path, rows).splitlines()
           if line.startswith("| 400 | DIFF Transformer (diff) |")][-1]  # the telemetry table's, after the paired one
    assert row.split("|")[3].strip() == f"{np.mean(rms['diff__seed0'][400]):.3f}"  # seed 0 alone


@pytest.mark.parametrize("script, args", [("scaling.py", ["--size-sweep"]), ("ablation.py", ["--sweep"])])
def test_a_study_script_on_a_missing_sweep_says_so_in_one_line(script, args, tmp_path):
    """The scripts as users start them (their analysis runs in process above)."""
    missing = tmp_path / "no-such-sweep"
    out = subprocess.run([sys.executable, str(REPO / "experiments" / script), *args, str(missing)], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{missing} is not a sweep directory" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr


def test_a_study_run_on_a_missing_corpus_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "experiments" / "ablation.py"), "--run", "--data",
                          str(tmp_path / "no-such.txt"), "--sweep", str(tmp_path / "sweep")], cwd=REPO, env=cli_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == f"ablation.py: error: data.path {tmp_path / 'no-such.txt'}: no such file or " \
                                 f"directory; set data.path to where the data is now"


def test_conversion_study_pairs_each_arm_with_the_llama_and_the_lambda_zero_control(rng):
    """experiments/conversion_study.py's report: each arm's differences per seed against both references (planted:
    diff − diff_lambda0 = the planted gap in every seed, whatever the seed's own level)."""
    import conversion_study

    seeds = [int(s) for s in rng.permutation(50)[:3]]
    level = {s: float(rng.normal(3.2, 0.1)) for s in seeds}  # each seed's own luck, shared by its arms
    gap = {"llama": 0.0, "diff_lambda0": -0.01, "diff": -0.03}

    def arm(name, seed):
        return dict(arm=name, seed=seed, val_before=3.59, val_after=level[seed] + gap[name],
                    word_ppl=40 + 10 * (level[seed] + gap[name]), tokens_per_s=50.0, peak_gb=10.0,
                    gflop_per_token=1.1, lambdas=None if name == "llama" else [0.01, -0.02])

    text = conversion_study.table([arm(a, s) for s in seeds for a in gap])
    control = text.split("minus the λ = 0 control")[1].split("\n")
    row = next(line for line in control if line.startswith("| diff |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3" and cells[2] == ", ".join(["-0.0200"] * 3) and float(cells[3]) == pytest.approx(-0.02)
    llama = text.split("validation loss after, minus the fine-tuned Llama")[1].split("\n")
    assert any(line.startswith("| diff_lambda0 | 3 | -0.0100, -0.0100, -0.0100 |") for line in llama)
    assert "| diff | 3 | 3.5900" in text  # the arm's own row: seeds, val loss before (identical, no spread)


@pytest.mark.slow
def test_quantization_study_evaluates_resumes_and_pairs_the_arms(tmp_path, monkeypatch):
    """The Fig. 8 study's driver on a 2-step main job of 2 seeds (retrieval data: both metrics), one granularity at
    16 and 4 bits: DIFF at its own and a shared scale, the Transformer once; its table pairs the members' own numbers;
    a rerun evaluates nothing; a study without 16 bits is refused. Cost: ~15 s on one worker (2 train groups, 6
    protocol runs), in process."""
    monkeypatch.chdir(REPO)
    main_job = tmp_path / "main"
    sweep_lib.run("configs/main.py:seeds=2,steps=2", ["model.n_layers=1", "data.batch_size=8",
                                                                  "train.eval_batches=1"], main_job, progress=False)
    out = tmp_path / "study"
    argv = ["--retrieval", str(main_job), "--text", str(tmp_path / "none"), "--out", str(out), "--bits", "16,4",
            "--granularities", "row", "--batches", "1", "--retrieval-n", "2"]
    assert quantization_study.main(argv) == 0
    rows = json.loads((out / "quantization.json").read_text())
    assert sorted((r["variant"], r["seed"], sorted(r["results"])) for r in rows) == [
        ("diff", 0, ["row/own", "row/shared"]), ("diff", 1, ["row/own", "row/shared"]),
        ("transformer", 0, ["row/own"]), ("transformer", 1, ["row/own"])]
    value = {(r["variant"], r["seed"], k): v["val_loss"] for r in rows for k, v in r["results"].items()}
    md = (out / "quantization.md").read_text()
    for scale in ("own", "shared"):  # DIFF's shared scale is paired with the Transformer's one map
        d = [value["diff", s, f"row/{scale}"][1] - value["transformer", s, "row/own"][1] for s in (0, 1)]
        drop = [value["diff", s, f"row/{scale}"][1] - value["diff", s, f"row/{scale}"][0]
                - value["transformer", s, "row/own"][1] + value["transformer", s, "row/own"][0] for s in (0, 1)]
        line = next(x for x in md.splitlines() if x.startswith(f"| row | {scale} | 4 | ") and "." in x.split("|")[4]
                    and len(x.split("|")[4].strip().split(".")[1].split()[0]) == 4)  # the loss table's row
        assert f"| {np.mean(d):+.4f} [" in line and f"| {np.mean(drop):+.4f} [" in line
        assert "too few seeds to judge at n = 2" in line
    assert (out / "quantization.png").stat().st_size > 0
    monkeypatch.setattr(eval_lib, "get", None)  # every setting is kept: nothing to evaluate
    assert quantization_study.main(argv) == 0
    assert (out / "quantization.md").read_text() == md
    with pytest.raises(ConfigError, match="bits must include 16"):
        quantization_study.main([*argv[:6], "--bits", "8,4"])

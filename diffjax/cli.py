"""`diffjax train | eval | sweep | prepare | summary | compile | hf | lm-eval | generate`.

    diffjax train [--config configs/x.py:arg] [--set a.b=c ...] [--workdir DIR]
        (no config: DIR's own config.json if it is a run directory, else the main job)
    diffjax eval --workdir DIR [--protocol NAME[,NAME...]|all] [--set eval.option=value]
    diffjax eval --compare RUN_A RUN_B --protocol NAME
    diffjax sweep --config configs/sweep_demo.py [--set a.b=c ...] [--workdir DIR]   |   diffjax sweep --report DIR
    diffjax prepare --path corpus/ --out shards/ --tokenizer cl100k_base   (text, JSONL, Parquet, Arrow; .gz / .zst)
    diffjax summary --config configs/paper.py:size=1.4B,arch=diff [--json]
    diffjax compile --config configs/paper.py:size=1.4B,arch=diff --target v5e-16 --set mesh.fsdp=-1 [--json FILE]
    diffjax hf export --workdir RUN [--step N] --out DIR
    diffjax hf import DIR --workdir RUN [--as diff] [--set a.b=c]
    diffjax lm-eval --workdir RUN --tasks T1,T2 [--num-fewshot k] [--limit n] [--include DIR] [--out FILE]
    diffjax generate --workdir RUN --prompt TEXT | --prompts FILE [--max-new-tokens n] [--temperature t]
        [--top-k k] [--top-p p] [--seed s]

train, sweep and eval also run as one process of several: --coordinator HOST:PORT --num-processes N
--process-id I (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), or --distributed to let JAX
detect the cluster (SLURM and multi-host TPU slices are detected without it); docs/multihost.md.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from pathlib import Path

from diffjax import config as config_lib  # plain data: `diffjax --help` imports no jax (commands do, late)
from diffjax import launcher, paths  # the environment alone; local paths and URLs (no jax either)
from diffjax.data import readers, sources
from diffjax.data.sources import DataError
from diffjax.data.tokenizer import TOKENIZERS
from diffjax.eval import PROTOCOLS  # plain data too: the registry imports a protocol's module when first asked

MAIN_JOB = "configs/main.py"


def _load_config(args) -> config_lib.Config:
    from diffjax import checks

    return checks.load(args.config, args.set)


def cmd_train(args) -> int:
    import jax

    from diffjax import checks
    from diffjax.eval import report
    from diffjax.train import run_config
    from diffjax.train.loop import train
    from diffjax.train.run_loader import load_run

    if not args.config and args.workdir and run_config.read(args.workdir) is not None:
        cfg = checks.check(run_config.load(paths.run_dir(args.workdir), args.set))  # continue a run with its own config
    elif not args.config or config_lib.find_config(args.config.partition(":")[0]).resolve() == \
            config_lib.find_config(MAIN_JOB).resolve():
        return _main_job(args)
    else:
        cfg = _load_config(args)
    workdir = paths.run_dir(args.workdir or cfg.train.workdir)
    result = train(cfg, workdir, progress=not args.no_progress, allow_config_change=args.allow_config_change)
    if result.interrupted:
        print(f"interrupted: {result.interrupted}", file=sys.stderr)
        return 130
    if jax.process_count() > 1:  # the saved final state, whole on each process's devices: process 0 needs no other
        result.state = load_run(workdir)[1]
    if jax.process_index() == 0:
        report.finish_run(cfg, workdir, result)
    return 0


def _main_job(args) -> int:
    from diffjax import main_job
    from diffjax import sweep as sweep_lib

    spec = args.config or MAIN_JOB
    sweep = sweep_lib.load(spec, args.set)
    workdir = paths.run_dir(args.workdir or sweep.base.train.workdir)
    seeds = 1 + max(m.seed for m in sweep.members)

    def setting(get) -> str:  # what the members train with (--set applies to them, not to the sweep's base)
        return "/".join(str(v) for v in sorted({get(m.config) for m in sweep.members}))

    print(f"main job ({spec}: a sweep of {len(sweep.members)} runs): "
          f"{', '.join(sorted({m.variant for m in sweep.members}))} × {seeds} seeds "
          f"on {setting(lambda c: c.data.n_needles)}-needle retrieval at length {setting(lambda c: c.data.seq_len)}, "
          f"{setting(lambda c: c.train.steps)} steps, in {workdir}")
    return 0 if main_job.run(sweep, workdir, progress=not args.no_progress) is not None else 130


def cmd_eval(args) -> int:
    from diffjax.eval.command import evaluate

    if args.compare and args.workdir:
        raise config_lib.ConfigError("--compare RUN_A RUN_B takes one --protocol NAME and no --workdir")
    if not args.compare and not args.workdir:
        raise config_lib.ConfigError("diffjax eval needs --workdir RUN (or --compare RUN_A RUN_B)")
    evaluate(args.compare or [args.workdir], protocol=args.protocol, sets=args.set, compare=bool(args.compare),
             as_json=args.json, out=args.out)
    return 0


def cmd_sweep(args) -> int:
    import jax

    from diffjax import sweep as sweep_lib
    from diffjax.sweep.report import write_report

    if args.report:
        if jax.process_index() != 0:  # a report is files only: process 0 writes them
            return 0
        written = write_report(args.report)
        print((paths.run_dir(args.report) / "results.md").read_text())
        print(f"written: {', '.join(str(p) for p in written.values())}")
        return 0
    if not args.config:
        raise config_lib.ConfigError("diffjax sweep needs --config FILE[:arg] (or --report DIR)")
    return 0 if sweep_lib.run(args.config, args.set, args.workdir, progress=not args.no_progress) else 130


def cmd_summary(args) -> int:
    from diffjax.summary import describe, summary

    info = summary(_load_config(args))
    print(json.dumps(info) if args.json else describe(info))
    return 0


EXIT_DOES_NOT_FIT = 3  # `diffjax compile`: the step compiled (or was refused by the compiler) but does not fit


def _size(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def cmd_compile(args) -> int:
    from diffjax.aot import targets
    from diffjax.aot.compile import PARTS, advice, compile_train_step

    cfg = _load_config(args)
    target = targets.parse(args.target, args.num_slices)
    try:
        report = compile_train_step(cfg, target)
    except targets.TargetUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = report.memory
    print(f"{cfg.name} on {report.target}: {report.devices} × {report.device_kind}, mesh "
          f"{' × '.join(f'{k} {v}' for k, v in report.mesh.items() if v > 1) or 'one device'}")
    print(f"  kernels: {', '.join(f'{op} -> {impl}' for op, impl in report.kernels.items()) or 'none (XLA)'}")
    print("  per device: " + ", ".join(f"{k} {_size(m[k])}" for k in (*PARTS, "total") if k in m)
          + f" of {_size(m['capacity'])}")
    ideal = f", {report.ideal_step_s:.3f} s at peak FLOP/s" if report.ideal_step_s else ""
    print(f"  step: {report.tokens_per_step:,} tokens, {report.flops_per_step:.3e} model FLOPs{ideal}; "
          f"compiled in {report.compile_s:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg.name, **report.to_dict()}, indent=2))
    if report.fits:
        print("  fits")
        return 0
    if report.compiler_error:
        print(f"  compiler: {report.compiler_error}")
    print(f"  {advice(report, cfg)}")
    return EXIT_DOES_NOT_FIT


def cmd_hf(args) -> int:
    from diffjax.hf import run

    if args.hf_command == "export":
        out = run.export_run(args.workdir, args.out, args.step)
        print(f"wrote {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    else:
        cfg = run.import_run(args.dir, args.workdir, args.set, as_arch=args.as_arch, start=args.start)
        m, stored = cfg.model, json.loads((Path(args.workdir) / "imported_from.json").read_text())["dtype"]
        ramp = f", ramped in over {m.lambda_ramp_steps} steps" if m.lambda_ramp_steps else ""
        same = "the same function at step 0" if ramp or args.start == "exact" else \
            "not the Llama's function at step 0: set model.lambda_ramp_steps"
        print(f"wrote run {args.workdir}: {m.arch}, {m.n_layers} layers, d_model {m.d_model}, computing in {m.dtype}"
              + (f" (the checkpoint stores {stored}: diffjax has no loss scaling)" if stored == "float16" else "")
              + (f"; converted from a Llama, start {args.start}: λ = {'0' if args.start == 'exact' else 'λ_init'}"
                 f"{ramp}, {same}" if args.as_arch else ""))
    return 0


def cmd_lm_eval(args) -> int:
    from diffjax.eval import lm_harness

    # evaluate() checks for lm-eval first (a ConfigError naming the extra, exit 2), so lm_eval is importable after
    results = lm_harness.evaluate(args.workdir, [t for t in args.tasks.split(",") if t], num_fewshot=args.num_fewshot,
                                  limit=args.limit, include_path=args.include, batch_size=args.batch_size,
                                  max_length=args.max_length, log_samples=args.log_samples)
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    out = paths.run_dir(args.out or paths.run_dir(args.workdir) / "eval" / "lm_eval.json")
    paths.makedirs(out.parent)
    out.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    print(f"wrote {out}")
    return 0


def cmd_generate(args) -> int:
    from diffjax import generate
    from diffjax.model.generate import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p)  # bad values: a ConfigError before any loading
    prompts = [args.prompt] if args.prompt is not None else generate.read_prompts(args.prompts)
    generate.run(args.workdir, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                 batch_size=args.batch_size)
    return 0


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a run's latest checkpoint with the KV cache (greedy at "
                       "--temperature 0); the run directory is only read", description="Continue each prompt with "
                       "the run's latest checkpoint: one prompt streams as it is produced; several print whole, in "
                       "order, each under a header line.")
    p.add_argument("--workdir", required=True, metavar="RUN", help="the run directory")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="the text to continue (empty: start a new document)")
    prompts.add_argument("--prompts", metavar="FILE", help="a file of prompts, one a line (blank lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to add to each prompt at "
                   "most (default 128; each stops earlier at the end of text); prompt + new tokens fit the run's "
                   "data.seq_len")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="divides the logits; 0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="draw from the k most probable tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="draw from the smallest set of most probable "
                   "tokens whose probability reaches p, in (0, 1] (default 1: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="the sampling seed (default 0): the same seed, the same text")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts decoded together (default 8)")
    p.set_defaults(handler=cmd_generate)


def _add_hf_parser(sub) -> None:
    p = sub.add_parser("hf", help="Hugging Face checkpoints: export a run, import a Llama / Mistral / Qwen / "
                       "DiffLlama directory")
    hf = p.add_subparsers(dest="hf_command", required=True)
    e = hf.add_parser("export", help="write a run's params as an HF directory (config.json + safetensors)")
    e.add_argument("--workdir", required=True, help="the run directory")
    e.add_argument("--step", type=int, help="a checkpointed step (default: the latest)")
    e.add_argument("--out", required=True, help="the HF directory to write")
    i = hf.add_parser("import", help="make a run directory from an HF Llama, Mistral, Qwen2, Qwen3 or DiffLlama "
                      "checkpoint")
    i.add_argument("dir", help="the HF directory (config.json + model.safetensors)")
    i.add_argument("--workdir", required=True, help="the new run directory")
    i.add_argument("--set", action="append", default=[], metavar="a.b=c", help="override a data/optim/train field")
    i.add_argument("--as", dest="as_arch", choices=["diff"], help="convert a Llama (Mistral, Qwen) into a DIFF "
                   "model that computes the same function (each head becomes A1 of a DIFF head; "
                   "docs/design.md §2)")
    i.add_argument("--start", default="exact", choices=["exact", "lambda-init", "axolotl", "paired"],
                   help="with --as diff, what A2 and λ start as: exact (λ = 0), lambda-init (fresh A2, λ = λ_init), "
                   "axolotl (W_Q2 = W_K2 = 0, λ's vectors 0), paired (A2 another of the Llama's heads, λ = λ_init); "
                   "all but exact are the Llama's function at step 0 only with model.lambda_ramp_steps (docs/hf.md)")
    p.set_defaults(handler=cmd_hf)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a run's latest checkpoint (diffjax[eval])")
    p.add_argument("--workdir", required=True, help="the run directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (configs/lm_eval_tasks.txt)")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's)")
    p.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction, < 1)")
    p.add_argument("--include", metavar="PATH", help="a directory of local task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, help="requests per compiled batch (default 8)")
    p.add_argument("--max-length", type=int, help="context window in tokens (default: the run's data.seq_len)")
    p.add_argument("--log-samples", action="store_true", help="keep every request and response in the JSON")
    p.add_argument("--out", help="the results JSON (default RUN/eval/lm_eval.json)")
    p.set_defaults(handler=cmd_lm_eval)


def _launch_parser() -> argparse.ArgumentParser:
    """The multi-process flags shared by train, sweep and eval."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("multi-process launch (docs/multihost.md)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes (env JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index (env JAX_PROCESS_ID)")
    g.add_argument("--distributed", action="store_true",
                   help="let JAX detect the cluster (TPU pod, SLURM, Open MPI) without the flags above")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S",
                   help="seconds without a heartbeat before a process counts as dead (default 100)")
    return p


# What to do when the storage refuses: the rerun of the same command then resumes a run from its last checkpoint.
_REMEDIES = {errno.EROFS: "make it writable (or use another directory)", errno.EACCES: "give this user access to it",
             errno.EPERM: "give this user access to it", errno.ENOSPC: "make room", errno.EDQUOT: "make room"}


def _refusal(e: OSError) -> str:
    """'FILE: CAUSE; what to do' for an OSError that names its file (a StorageError says all itself)."""
    if not (e.filename and e.strerror):
        return str(e)
    remedy = _REMEDIES.get(e.errno)
    return f"{e.filename}: {e.strerror}" + (f"; {remedy}, then rerun the same command" if remedy else "")


def _run_handler(args) -> int:
    """The command, with errors reported as one clear line; in a multi-process run, a failure ends this process
    at once (a normal exit would wait at the runtime's shutdown barrier for processes that may be gone)."""
    multi = False
    try:
        _check_urls(args)
        if args.command in ("train", "sweep", "eval"):
            from diffjax import distributed  # here: it imports jax (0.5 GB of memory), which `prepare` never needs
            from diffjax.train.checkpoint import quiet_background_errors

            quiet_background_errors()
            distributed.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed,
                                   heartbeat_timeout=args.heartbeat_timeout)
            multi = distributed.is_multi_process()
        return args.handler(args)
    except (config_lib.ConfigError, DataError, FileNotFoundError) as e:  # FileNotFound: e.g. no checkpoint
        kind = ("config error" if isinstance(e, config_lib.ConfigError) else
                "data error" if isinstance(e, DataError) else "error")
        print(f"{kind}: {e}", file=sys.stderr)
        code = 2
    except OSError as e:  # the environment refused (a full disk, permissions): not a bug to trace back
        print(f"error: {_refusal(e)}", file=sys.stderr)
        code = 1
    except Exception as e:
        if not multi:
            raise
        distributed.exit_after_failure(e)
    if multi:
        distributed.exit_now(code)
    return code


# Where a URL may stand: run directories and reports (Orbax and epath reach object storage); elsewhere the files are
# read or written with local file APIs, so a URL there is refused before anything is written.
_REMOTE_OK = ("workdir", "compare", "report", "out")
_LOCAL_ONLY = {"prepare": ("path", "out"), "hf": ("dir", "out")}


def _check_urls(args) -> None:
    """Each gs:// or s3:// argument reachable (its bucket listed) or refused in one line, before any work."""
    local = _LOCAL_ONLY.get(args.command, ()) + (("workdir",) if getattr(args, "hf_command", None) == "import" else ())
    for name in local:
        if paths.is_remote(getattr(args, name, None)):
            raise config_lib.ConfigError(f"--{name} {getattr(args, name)}: {args.command} reads and writes local "
                                         f"files; copy to or from the bucket (gcloud storage cp -r, aws s3 cp "
                                         f"--recursive) and give a local directory")
    for name in _REMOTE_OK:
        if name in local:
            continue
        value = getattr(args, name, None)
        for url in value if isinstance(value, list) else [value]:
            paths.check_reachable(url)


def _add_prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a text / JSONL / Parquet / Arrow corpus into ArrayRecord shards "
                       "(data.source=shards)",
                       description="Tokenize a corpus once into ArrayRecord shards with their metadata; train "
                                   "with --set data.source=shards --set data.path=OUT --set data.tokenizer=NAME.")
    p.add_argument("--source", choices=("auto", *readers.FORMATS), default="auto",
                   help="what --path holds (default: what the file suffixes say: .parquet, .arrow (a "
                        "datasets.save_to_disk directory), .jsonl / .json (also .gz, .zst), else text)")
    p.add_argument("--path", required=True, help="a file or a directory (read recursively, sorted)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="cl100k_base", metavar="NAME|DIR", help=f"{' or '.join(TOKENIZERS)}, or a "
                   "directory holding a Hugging Face tokenizer.json (default cl100k_base)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet or Arrow column holding the document")
    p.add_argument("--text-split", choices=sources.TEXT_SPLITS, default="paragraph",
                   help="text documents: blank-line-separated paragraphs, or one per file")
    p.add_argument("--seq-len", type=int, default=2048, metavar="N", help="the training length (data.seq_len) the "
                   "documents are compared with: a warning when the mean document is under a quarter of it "
                   "(default 2048, the paper's)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard before rolling over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_prepare)


def cmd_prepare(args) -> int:
    from diffjax.data.prepare import prepare

    if args.seq_len < 2:
        raise config_lib.ConfigError(f"--seq-len must be a training length of 2 tokens or more, got {args.seq_len}")
    prepare(args.path, args.out, source=args.source, tokenizer=args.tokenizer, text_field=args.text_field,
            text_split=args.text_split, workers=args.workers, shard_tokens=args.shard_tokens,
            progress=not args.no_progress, seq_len=args.seq_len)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffjax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"shipped configs (any directory): {', '.join(config_lib.shipped_configs())}\nevaluation protocols: "
               f"{', '.join(PROTOCOLS)} (docs/design.md §6)")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = _launch_parser()

    p = sub.add_parser("train", parents=[launch], help="train or resume a run (no --config: the run in --workdir "
                       "with its own config.json, else the main job, DIFF vs Transformer)")
    p.add_argument("--config", help=f"config file[:arg] (default: --workdir's config.json if it has one, else the "
                   f"main job, {MAIN_JOB})")
    p.add_argument("--set", action="append", default=[], metavar="a.b=c", help="override a config field")
    p.add_argument("--workdir", help="run directory (default: train.workdir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a run with settings that change its trajectory (config.json records each segment)")
    p.set_defaults(handler=cmd_train)

    p = sub.add_parser("eval", parents=[launch], formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="run evaluation protocols on a run's latest checkpoint (or compare two runs)",
                       epilog="evaluation protocols (docs/design.md §6):\n" + "\n".join(
                           f"  {name:<17}{what}" for name, what in PROTOCOLS.items()))
    p.add_argument("--workdir", help="the run directory")
    p.add_argument("--protocol", help="a protocol name (diffjax.eval), several joined by commas, or 'all' that "
                                      "apply (default: validation and retrieval, where they apply)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the tables")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="one table and figure for two runs")
    p.add_argument("--out", help="with --compare: where to write (default RUN_A/eval/compare-<RUN_B>)")
    p.add_argument("--set", action="append", default=[], metavar="eval.x=v|mesh.x=n",
                   help="a protocol option (eval.*), or a different mesh (mesh.*)")
    p.set_defaults(handler=cmd_eval)

    p = sub.add_parser("sweep", parents=[launch],
                       help="train a sweep's members, one compiled program per group; or rebuild its report")
    p.add_argument("--config", help="sweep file[:arg] defining get_sweep(arg)")
    p.add_argument("--set", action="append", default=[], metavar="a.b=c",
                   help="override a field of every member, or a sweep option (sweep.vary_data, sweep.devices, "
                        "sweep.chunk, sweep.reference, sweep.execution, sweep.paired_init)")
    p.add_argument("--workdir", help="sweep directory (default: runs/sweeps/<name>)")
    p.add_argument("--report", metavar="DIR", help="rebuild results.{md,csv,png} of a sweep directory and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_sweep)

    p = sub.add_parser("summary", help="parameters, λ_init per layer and training FLOPs per token")
    p.add_argument("--config", required=True, help="config file[:arg]")
    p.add_argument("--set", action="append", default=[], metavar="a.b=c", help="override a config field")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=cmd_summary)

    p = sub.add_parser("compile", help="compile the training step for a TPU slice or GPU node on this host (no "
                                       "accelerator needed): per-device memory, whether it fits, the kernels used")
    p.add_argument("--config", required=True, help="config file[:arg]")
    p.add_argument("--target", required=True, help="v4-8…, v5e-1…v5e-256, v5p-8…, v6e-…, h100x1…h100x8, a100x8")
    p.add_argument("--num-slices", type=int, default=1, help="TPU slices (multislice) or GPU nodes (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="a.b=c", help="override a config field")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(handler=cmd_compile)

    _add_prepare_parser(sub)
    _add_hf_parser(sub)
    _add_generate_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("diffjax").setLevel(logging.INFO)  # ours at INFO; Orbax / absl stay quiet
    from diffjax import host

    if args.command == "compile":
        host.cpu_only()  # nothing runs here: the target's compiler is reached through its topology
    elif args.command != "prepare":  # it reads and tokenizes: JAX's backends (0.6 GB of memory, seconds) unused
        launch = ("coordinator", "num_processes", "process_id", "distributed")
        multi_process = (any(getattr(args, k, None) for k in launch) or "JAX_COORDINATOR_ADDRESS" in os.environ
                         or launcher.says_multi_process())
        host.cpu_unless_accelerator(start=not multi_process)
    return _run_handler(args)


if __name__ == "__main__":
    sys.exit(main())

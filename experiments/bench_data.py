"""Data pipeline throughput vs. the training step's consumption (`configs/small.py:size=small,arch=diff`), and
`diffjax prepare` on a large corpus against the tokenizer's own rate.

    python experiments/bench_data.py [CORPUS] [--json out.json] [--step-tokens-per-s X] [--batches N]
    python experiments/bench_data.py --prepare --gb 1 --format parquet --tokenizer cl100k_base [--json out.json]

Tokenization MB/s and the Grain pipeline's tokens/s per source, against the step's consumption: `--step-tokens-per-s`
(from experiments/bench_train.py), else a forward+backward proxy measured here (no optimizer update: it overstates the
step's speed, so the ≥10× check is conservative).

`--prepare`: writes WikiText-2's paragraphs (../shared/data), repeated to `--gb` GB, as one JSONL or Parquet file
under `--scratch` (kept for the next run), runs `diffjax prepare` on it under `/usr/bin/time -v` (its largest
process's peak RSS) while sampling the peak RSS of its whole process tree, then times the tokenizer's own
`encode_batch` on the same ~1 MB batches of documents split over `--workers` processes (the same cores, without
reading, IPC or writing); tokens/s of both and their ratio. The shards are deleted afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import cpu_model, versions  # noqa: E402

from diffjax import config as config_lib  # noqa: E402
from diffjax.data import pipeline, prepare, readers, sources  # noqa: E402
from diffjax.data.tokenizer import get_tokenizer  # noqa: E402

CORPORA = ("wikitext2_valid.txt", "tinyshakespeare.txt")
WIKITEXT = ("wikitext2_valid.txt", "wikitext2_test.txt")  # --prepare's paragraphs


def default_corpus() -> str | None:
    for base in (ROOT.parent / "shared" / "data", Path("../shared/data"), ROOT / "data"):
        for name in CORPORA:
            if (base / name).is_file():
                return str(base / name)
    return None


def tokenize_mb_s(docs: list[str], name: str) -> float:
    tok = get_tokenizer(name)
    n_bytes = sum(len(d.encode()) for d in docs)
    tok.encode_batch(docs[:100])  # warm up
    t = time.perf_counter()
    for d in docs:
        tok.encode(d)
    return n_bytes / (time.perf_counter() - t) / 1e6


def prepare_mb_s(path: str, name: str, workers: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        prepare.prepare(path, out, tokenizer=name, workers=workers, progress=False, log=lambda *a: None)
        return Path(path).stat().st_size / (time.perf_counter() - t) / 1e6


def pipeline_tokens_s(data_cfg, batches: int) -> float:
    it = pipeline.make_iterator(data_cfg, process_index=0, process_count=1)
    for _ in range(3):  # warm up: start threads / workers, fill the prefetch buffer
        it.next()
    t = time.perf_counter()
    for _ in range(batches):
        it.next()
    dt = time.perf_counter() - t
    it.close()
    return batches * data_cfg.batch_size * data_cfg.seq_len / dt


def step_tokens_s(cfg, steps: int = 3) -> tuple[float, str]:
    """Model forward+backward tokens/s on the config's batch (the train step's dominant cost)."""
    import jax
    import jax.numpy as jnp
    import optax

    from diffjax.model import DecoderLM

    model = DecoderLM(cfg.model)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = jnp.zeros((b, t), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)

    @jax.jit
    def grad_step(params, tokens):
        def loss(p):
            logits = model.apply(p, tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens).mean()

        return jax.value_and_grad(loss)(params)

    jax.block_until_ready(grad_step(params, tokens))  # compile
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(grad_step(params, tokens))
    return steps * b * t / (time.perf_counter() - start), "model forward+backward proxy (no optimizer update)"


def write_corpus(path: Path, gb: float, fmt: str) -> Path:
    """WikiText-2's paragraphs repeated to `gb` GB of text, one document a line (JSONL) or row (Parquet, row groups
    of 20k rows, ~10 MB, zstd as Hugging Face's are)."""
    if path.is_file():
        return path
    if default_corpus() is None:
        raise SystemExit("WikiText-2 not found: ../shared/data/wikitext2_*.txt beside the checkout")
    base = Path(default_corpus()).parent
    docs = [d for name in WIKITEXT for d in sources.load_corpus(base / name, "text").documents]
    repeats = int(gb * 1e9 / sum(len(d.encode()) for d in docs)) + 1
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "jsonl":
        block = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        with open(tmp, "wb") as f:
            for _ in range(repeats):
                f.write(block)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = pa.table({"text": docs * (20_000 // len(docs) + 1)})
        with pq.ParquetWriter(tmp, rows.schema, compression="zstd") as writer:
            for _ in range(repeats * len(docs) // rows.num_rows + 1):
                writer.write_table(rows, row_group_size=20_000)
    tmp.rename(path)
    return path


class TreeRss:
    """The peak of the summed RSS of a process and its descendants, sampled every 0.1 s from /proc (an upper bound:
    pages the processes share count once per process)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        parents = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                parents[int(stat.parent.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
        tree, frontier = [self.pid], [self.pid]
        while frontier:
            frontier = [p for p, parent in parents.items() if parent in frontier]
            tree += frontier
        return tree

    def _run(self):
        while not self._stop.wait(0.1):
            total = 0
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
                total += int(m.group(1)) * 1024 if m else 0
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> dict:
    """`diffjax prepare` as a user runs it, under /usr/bin/time -v; its tokens, seconds and peak RSS."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "diffjax.cli", "prepare", "--path", str(corpus), "--out",
           str(out), "--tokenizer", tokenizer, "--workers", str(workers), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's diffjax
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = TreeRss(proc.pid)
    stdout, stderr = proc.communicate()
    seconds, tree_peak = time.perf_counter() - start, tree.stop()
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{stdout}\n{stderr}")
    meta = json.loads((out / prepare.METADATA).read_text())
    max_rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1)) * 1024
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", stderr).group(1)) for kind in ("User", "System"))
    return {"command": " ".join(cmd[2:]), "log": stdout.strip(), "n_docs": meta["n_docs"],
            "n_tokens": meta["n_tokens"], "seconds": seconds, "tokens_per_s": meta["n_tokens"] / seconds,
            "cpu_seconds": cpu, "tokens_per_cpu_s": meta["n_tokens"] / cpu,
            "largest_process_max_rss_bytes": max_rss, "process_tree_peak_rss_bytes": tree_peak}


def _encode_share(args) -> tuple[int, float, float]:
    """(tokens, seconds and CPU seconds inside encode_batch) of every `workers`-th ~1 MB batch of the corpus from
    the `index`-th."""
    corpus, source, tokenizer, index, workers, barrier = args
    tok = get_tokenizer(tokenizer)
    tok.encode_batch(["warm up"])
    tokens, seconds, cpu, batch, chars, n = 0, 0.0, 0.0, [], 0, 0
    barrier.wait()

    def encode(batch):
        nonlocal tokens, seconds, cpu
        t, c = time.perf_counter(), time.process_time()  # the process's CPU: all of tiktoken's threads
        tokens += sum(map(len, tok.encode_batch(batch)))
        seconds, cpu = seconds + time.perf_counter() - t, cpu + time.process_time() - c

    for doc, _ in readers.documents(Path(corpus), source, readers.Counts()):
        batch.append(doc)
        chars += len(doc)
        if chars >= prepare.CHUNK_CHARS:
            if n % workers == index:
                encode(batch)
            batch, chars, n = [], 0, n + 1
    if batch and n % workers == index:
        encode(batch)
    return tokens, seconds, cpu


def encode_batch_rate(corpus: Path, source: str, tokenizer: str, workers: int) -> dict:
    """The tokenizer's own rate on `workers` cores: each process encodes its share of prepare's batches; tokens over
    the slowest process's seconds inside encode_batch (reading the file is not timed)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(workers) as pool:
        barrier = manager.Barrier(workers)
        shares = pool.map(_encode_share, [(str(corpus), source, tokenizer, i, workers, barrier)
                                          for i in range(workers)])
    tokens, seconds, cpu = sum(t for t, _, _ in shares), max(s for _, s, _ in shares), sum(c for _, _, c in shares)
    return {"n_tokens": tokens, "seconds_in_encode_batch": seconds, "tokens_per_s": tokens / seconds,
            "cpu_seconds_in_encode_batch": cpu, "tokens_per_cpu_s": tokens / cpu}


def bench_prepare(args) -> dict:
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(scratch / f"wikitext2-x-{args.gb:g}GB.{args.format}", args.gb, args.format)
    res = {"corpus": str(corpus), "corpus_bytes": corpus.stat().st_size, "format": args.format,
           "tokenizer": args.tokenizer, "workers": args.workers, "cpu": cpu_model(), "cores": os.cpu_count(),
           "versions": versions("numpy", "pyarrow", "tiktoken") | {"array-record": metadata.version("array-record")},
           "date": time.strftime("%Y-%m-%d")}
    out = scratch / f"shards-{args.tokenizer}-{corpus.stem}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        res["prepare"] = run_prepare(corpus, out, args.tokenizer, args.workers)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if not args.no_baseline:
        res["encode_batch"] = encode_batch_rate(corpus, args.format, args.tokenizer, args.workers)
        res["prepare_over_encode_batch"] = res["prepare"]["tokens_per_s"] / res["encode_batch"]["tokens_per_s"]
        # per CPU second: what the wall-clock ratio is where the two have the cores to themselves (both fill them)
        res["prepare_over_encode_batch_per_cpu_s"] = (res["prepare"]["tokens_per_cpu_s"]
                                                      / res["encode_batch"]["tokens_per_cpu_s"])
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", default=default_corpus(), help="a text file (default: wikitext2)")
    parser.add_argument("--config", default=str(ROOT / "configs/small.py") + ":size=small,arch=diff")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--step-tokens-per-s", type=float, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--prepare", action="store_true", help="measure `diffjax prepare` on a large corpus instead")
    parser.add_argument("--gb", type=float, default=1.0, help="--prepare: the corpus's size in GB of text")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", help="--prepare: the corpus file")
    parser.add_argument("--tokenizer", default="cl100k_base", help="--prepare: byte or cl100k_base")
    parser.add_argument("--workers", type=int, default=2, help="--prepare: prepare's workers, the baseline's processes")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="--prepare: where the corpus and shards go")
    parser.add_argument("--no-baseline", action="store_true", help="--prepare: do not time encode_batch")
    args = parser.parse_args(argv)
    if args.prepare:
        return bench_prepare(args)
    if not args.corpus:
        parser.error("no corpus found; pass a text file path")


    cfg = config_lib.load(args.config)
    data = cfg.data
    docs = sources.load_corpus(args.corpus, "text").documents
    res = {"corpus": args.corpus, "corpus_mb": Path(args.corpus).stat().st_size / 1e6, "n_docs": len(docs),
           "batch": [data.batch_size, data.seq_len], "cpu": cpu_model(), "cores": os.cpu_count(),
           "versions": versions("grain", "tiktoken")}
    for name in ("byte", "cl100k_base"):
        res[f"tokenize_mb_s_{name}"] = tokenize_mb_s(docs, name)
        res[f"prepare_mb_s_{name}_2workers_incl_startup"] = prepare_mb_s(args.corpus, name, workers=2)

    with tempfile.TemporaryDirectory() as shards:
        prepare.prepare(args.corpus, shards, tokenizer=data.tokenizer, workers=2, progress=False, log=lambda *a: None)
        runs = {
            f"text_{data.tokenizer}": dataclasses.replace(data, source="text", path=args.corpus),
            "text_cl100k_base": dataclasses.replace(data, source="text", path=args.corpus, tokenizer="cl100k_base"),
            f"shards_{data.tokenizer}": dataclasses.replace(data, source="shards", path=shards),
            f"shards_{data.tokenizer}_2workers": dataclasses.replace(data, source="shards", path=shards,
                                                                     num_workers=2),
            "synthetic": dataclasses.replace(data, source="synthetic"),
        }
        for key, dcfg in runs.items():
            res[f"pipeline_tokens_s_{key}"] = pipeline_tokens_s(dcfg, args.batches)

    if args.step_tokens_per_s:
        res["step_tokens_s"], res["step_source"] = args.step_tokens_per_s, "--step-tokens-per-s"
    else:
        import jax

        res["step_tokens_s"], res["step_source"] = step_tokens_s(cfg)
        res["versions"]["jax"] = jax.__version__
        print("note: the step figure is a proxy; measure the full train step with experiments/bench_train.py")
    slowest = min(v for k, v in res.items() if k.startswith("pipeline_tokens_s_"))
    res["slowest_pipeline_over_step"] = slowest / res["step_tokens_s"]
    res["keeps_up_10x"] = res["slowest_pipeline_over_step"] >= 10

    for k, v in res.items():
        print(f"{k:>42}: {v:,.1f}" if isinstance(v, float) else f"{k:>42}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

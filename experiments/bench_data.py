"""Data pipeline throughput vs. the training step's consumption (`configs/small.py:size=small,arch=diff`).

    python experiments/bench_data.py [CORPUS] [--json out.json] [--step-tokens-per-s X] [--batches N]

Tokenization MB/s and the Grain pipeline's tokens/s per source, against the step's consumption: `--step-tokens-per-s`
(from experiments/bench_train.py), else a forward+backward proxy measured here (no optimizer update: it overstates the
step's speed, so the ≥10× check is conservative).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import cpu_model, versions  # noqa: E402

from diffjax import config as config_lib  # noqa: E402
from diffjax.data import pipeline, prepare, sources  # noqa: E402
from diffjax.data.tokenizer import get_tokenizer  # noqa: E402

CORPORA = ("wikitext2_valid.txt", "tinyshakespeare.txt")


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", default=default_corpus(), help="a text file (default: wikitext2)")
    parser.add_argument("--config", default=str(ROOT / "configs/small.py") + ":size=small,arch=diff")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--step-tokens-per-s", type=float, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
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

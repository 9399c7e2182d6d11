"""diffjax against its peer, Hugging Face transformers' DiffLlama (PyTorch), on one training step of the same model,
side by side in one process.

    python experiments/bench_peer.py                                  # L 4, D 256, h 2, d 64, batch 4 × 512, float32
    python experiments/bench_peer.py --steps 20 --json out.json
    python experiments/bench_peer.py --impl xla --impl causal_blocks      # several diffjax attention impls, interleaved

Needs the `peer` extra (`pip install -e ".[peer]"`: torch, a CPU build is enough, and transformers >= 5.23). Both
sides start from the same weights and must agree on the first step's loss; the peer's attention runs as `eager` and
as `sdpa`; rounds interleave the sides (docs/benchmarks.md, "Train step against the peer").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_train import Runner  # noqa: E402
from benchlib import cpu_model, versions  # noqa: E402

from diffjax import config as config_lib  # noqa: E402
from diffjax import sharding  # noqa: E402
from diffjax.hf import save_pretrained  # noqa: E402

MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=2", "model.head_dim=64", "model.dtype=float32",
         "model.vocab_size=512"]


def diffjax_side(cfg, ids: np.ndarray):
    """(step() -> loss of that step, the initial params) for the compiled diffjax train step on batch `ids`."""
    b, t = ids.shape
    mask = np.ones((b, t), np.int32)
    mask[:, -1] = 0  # the last position has no next token (as HF's shifted labels)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    runner = Runner("diffjax", cfg, sharding.make_mesh(cfg.mesh), batch={
        "tokens": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask, "positions": positions,
        "segment_ids": np.ones((b, t), np.int32)})
    params = jax.tree.map(lambda x: x[0], jax.device_get(runner.state["train"].params))  # the one member's
    return (lambda: float(jax.block_until_ready(runner.advance()[1]["loss"])[0])), params


def peer_side(path: Path, ids: np.ndarray, attention: str, cfg):
    """step() -> loss of one PyTorch training step of DiffLlama loaded from `path` with `attention`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2),
                            eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    tokens = torch.from_numpy(ids.astype(np.int64))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if cfg.optim.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
        opt.step()
        return float(loss.detach())

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each side per round)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="more diffjax config overrides (a.b=c)")
    parser.add_argument("--impl", action="append", default=[],
                        help="model.attention_impl of a diffjax side (repeat for several; default: the config's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch
    import transformers

    cfg = config_lib.load("configs/small.py:size=tiny,arch=diff",
                          [*MODEL, f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
                           "optim.warmup_steps=0", *args.set])
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (args.batch, args.seq_len)).astype(np.int32)
    impls = args.impl or [cfg.model.attention_impl]
    ours = {}
    for impl in impls:
        ours[impl], params = diffjax_side(config_lib.replace_field(cfg, "model.attention_impl", impl), ids)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(cfg.model, params, tmp)
        sides = {**{_name(i, impls): step for i, step in ours.items()},
                 **{f"hf_{a}": peer_side(Path(tmp), ids, a, cfg) for a in ("eager", "sdpa")}}
    first = {name: step() for name, step in sides.items()}  # the first step: compiles diffjax, same loss for all
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    base = first[_name(impls[0], impls)]
    for name, loss in first.items():
        if abs(loss - base) > 1e-4 * abs(base):
            raise SystemExit(f"{name}'s first loss {loss} differs from diffjax's {base}: not the same model")
    for _ in range(args.warmup):
        for step in sides.values():
            step()
    times = {name: [] for name in sides}
    for _ in range(args.steps):
        for name, step in sides.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    result = {
        "device": cpu_model(), "versions": versions("jax", "jaxlib", "flax", "optax") |
        {"torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(["python experiments/bench_peer.py", *(sys.argv[1:] if argv is None else argv)]),
        "model": MODEL, "seq_len": args.seq_len, "batch": args.batch, "rounds": args.steps,
        "first_loss": first,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "impls": impls,
        "ratio_diffjax_over": {f"{ours_name} / {k}": statistics.median(a / b for a, b in zip(times[ours_name], v,
                                                                                             strict=True))
                               for ours_name in (_name(i, impls) for i in impls)
                               for k, v in times.items() if k.startswith("hf_")},
    }
    tokens = args.batch * args.seq_len
    for name, med in result["median_step_s"].items():
        print(f"{name:>10}: {med * 1e3:8.1f} ms/step  {tokens / med:9,.0f} tokens/s")
    for name, ratio in result["ratio_diffjax_over"].items():
        print(f"{name}: {ratio:.3f} (median of {args.steps} paired rounds; < 1: diffjax faster)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _name(impl: str, impls: list[str]) -> str:
    """"diffjax" for a single side (the JSON keys of earlier runs), "diffjax[impl]" for several."""
    return "diffjax" if len(impls) == 1 else f"diffjax[{impl}]"


if __name__ == "__main__":
    from diffjax import host

    host.run_script(main)

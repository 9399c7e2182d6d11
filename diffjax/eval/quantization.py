"""Protocol "quantization": absmax dynamic post-training quantization of the attention logits (paper §3.7,
Fig. 8; docs/design.md §6).

Inside every attention call the pre-softmax logits `q kᵀ/√d` are fake-quantized to `bits` bits,
`x_q = round(x / scale) · scale` with `scale = max|x| / (2^(bits−1) − 1)` taken over the causally visible
entries only (masked entries neither set the scale nor get unmasked), per tensor, per (batch element, head) or
per query row (`granularity`); DIFF quantizes each of its two maps separately. The op is
`diffjax.kernels.quantized` (XLA), registered as kernel impl `xla_q{bits}_{granularity}`, and the model runs
with `model.attention_impl` set to it. 16 bits means no quantization: the run's own model and impl, unchanged.
Every built-in arch calls the ops (`dint` both, each quantized; `sink` the standard op with its sink logits, which
stay unquantized); an arch that computes its attention itself (`Arch.op=None`) has no op to swap: the protocol does
not apply to it, and asking for it is a config error.

Per bit width: the validation loss (mean next-token cross-entropy over the loss-masked targets of the first
`eval_batches` validation batches, the same batches for every width; 0 takes the run's `train.eval_batches`)
and, when the run's data has the synthetic retrieval task, the exact retrieval accuracy (`retrieval_accuracy`
over `retrieval_n` examples per depth). The paper's metric, zero-shot HellaSwag accuracy, needs a
multiple-choice dataset that this protocol does not take: it is left out here (the `icl` protocol scores
choices by log-likelihood).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffjax import checks, kernels
from diffjax.config import Config, ConfigError
from diffjax.data.pipeline import validation_iterator
from diffjax.eval import Protocol, register
from diffjax.eval.retrieval import applies as has_retrieval
from diffjax.eval.retrieval import retrieval_accuracy
from diffjax.kernels import quantized
from diffjax.model import archs
from diffjax.train.step import token_losses

NONE_BITS = 16  # the paper's unquantized configuration


def quantized_impl(bits: int, granularity: str) -> str:
    """Register (idempotently) the kernel impl quantizing logits to `bits` bits at `granularity`; its name."""
    if granularity not in quantized.GRANULARITIES:
        raise ConfigError(f"eval.granularity: choose one of {quantized.GRANULARITIES}, got {granularity!r}")
    name = f"xla_q{bits}_{granularity}"
    if name not in kernels.names():
        kw = {"bits": bits, "granularity": granularity}
        kernels.register(name, attention=functools.partial(quantized.attention, **kw),
                         diff_attention=functools.partial(quantized.diff_attention, **kw), features=("sinks",))
    return name


def quantized_config(cfg: Config, bits: int, granularity: str) -> Config:
    """`cfg` with its attention logits quantized to `bits` bits (`cfg` itself at 16 bits)."""
    if bits == NONE_BITS:
        return cfg
    model = dataclasses.replace(cfg.model, attention_impl=quantized_impl(bits, granularity))
    checks.check_model(model)
    return dataclasses.replace(cfg, model=model)


@functools.lru_cache(maxsize=16)
def _loss_sums(cfg: Config):
    @jax.jit
    def sums(params, batch):
        losses, _ = token_losses(params, batch, cfg)
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(losses * mask), jnp.sum(mask)

    return sums


def validation_loss(cfg: Config, params, batches: list[dict]) -> float:
    """Mean cross-entropy over the loss-masked targets of `batches`."""
    sums, total, count = _loss_sums(cfg), 0.0, 0.0
    for batch in batches:
        s, c = jax.device_get(sums(params, batch))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def quantization(cfg: Config, params, *, bits: tuple[int, ...] = (16, 8, 6, 4), granularity: str = "tensor",
                 eval_batches: int = 0, retrieval_n: int = 32, seed: int | None = None) -> dict:
    """{"bits": [...], "val_loss": [per width], "retrieval_accuracy": [per width] (retrieval data only), ...}."""
    if not applies(cfg):
        raise ConfigError(f"quantization: arch {cfg.model.arch!r} computes its attention itself (no kernel op), so "
                          f"there is no op whose logits the quantized impl could replace")
    if not bits or any(not 2 <= b <= NONE_BITS for b in bits):
        raise ConfigError(f"eval.bits: need bit widths in [2, {NONE_BITS}] ({NONE_BITS} = unquantized), got {bits}")
    if granularity not in quantized.GRANULARITIES:
        raise ConfigError(f"eval.granularity: choose one of {quantized.GRANULARITIES}, got {granularity!r}")
    n_batches = eval_batches or cfg.train.eval_batches
    if n_batches <= 0 or retrieval_n <= 0:
        raise ConfigError(f"eval.eval_batches and eval.retrieval_n must be positive, got {eval_batches} and "
                          f"{retrieval_n}")
    params = nn.meta.unbox(params)
    data = validation_iterator(cfg.data)
    try:
        batches = [{k: jnp.asarray(v) for k, v in data.next().items()} for _ in range(n_batches)]
    finally:
        data.close()
    retrieval = has_retrieval(cfg)
    from rich.progress import track

    result: dict = {"bits": [int(b) for b in bits], "granularity": granularity, "eval_batches": n_batches,
                    "val_loss": []}
    if retrieval:
        result |= {"retrieval_n": retrieval_n, "retrieval_accuracy": [], "retrieval_by_depth": []}
    for b in track(bits, description="quantization", disable=not sys.stderr.isatty(), transient=True):
        run_cfg = quantized_config(cfg, b, granularity)
        result["val_loss"].append(validation_loss(run_cfg, params, batches))
        if retrieval:
            acc = retrieval_accuracy(run_cfg, params, n=retrieval_n, seed=seed)
            result["retrieval_accuracy"].append(acc["mean"])
            result["retrieval_by_depth"].append({str(d): a for d, a in acc["by_depth"].items()})
    return result


# ------------------------------------------------------------------------------------------ table and figure
def _metrics(results: dict[str, dict]) -> list[tuple[str, str]]:
    metrics = [("val_loss", "val loss")]
    if all("retrieval_accuracy" in r for r in results.values()):
        metrics.append(("retrieval_accuracy", "retrieval acc."))
    return metrics


def markdown(results: dict[str, dict]) -> str:
    metrics = _metrics(results)
    header = " | ".join(f"{label} {name}" for label in results for _, name in metrics)
    lines = [f"| bits | {header} |", "|---" * (1 + len(results) * len(metrics)) + "|"]
    widths = sorted({b for r in results.values() for b in r["bits"]}, reverse=True)
    for b in widths:
        cells = []
        for r in results.values():
            for key, _ in metrics:
                cells.append(f"{r[key][r['bits'].index(b)]:.4f}" if b in r["bits"] else "–")
        lines.append(f"| {b}{' (none)' if b == NONE_BITS else ''} | " + " | ".join(cells) + " |")
    granularity = ", ".join(sorted({r["granularity"] for r in results.values()}))
    return (f"Attention-logit quantization (paper §3.7, Fig. 8), absmax per {granularity}\n\n"
            + "\n".join(lines) + "\n")


def plot(results: dict[str, dict], path) -> None:
    from diffjax.plotting import save, subplots

    metrics = _metrics(results)
    fig, axes = subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5), squeeze=False)
    for ax, (key, name) in zip(axes[0], metrics, strict=True):
        widths = sorted({b for r in results.values() for b in r["bits"]}, reverse=True)
        for label, r in results.items():
            order = sorted(range(len(r["bits"])), key=lambda i: -r["bits"][i])
            ax.plot([widths.index(r["bits"][i]) for i in order], [r[key][i] for i in order], "o-", label=label)
        ax.set_xticks(range(len(widths)), [str(b) for b in widths])  # 16 (none) on the left, as in Fig. 8
        ax.set(xlabel="attention-logit bits", ylabel=name)
        ax.legend(fontsize=8)
    save(fig, path)


def applies(cfg: Config) -> bool:
    """Every run whose arch calls a kernel op: the quantized impl stands in for it (an arch that computes its
    attention itself, `Arch.op=None`, has no op to swap; `quantized_config` refuses it)."""
    return archs.get(cfg.model.arch).op is not None


register(Protocol("quantization", quantization, applies, markdown=markdown, plot=plot))

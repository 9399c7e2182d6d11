"""Protocol "quantization": absmax post-training quantization of the attention logits inside the op (paper §3.7,
Fig. 8): validation loss and retrieval accuracy per bit width, and per layer the error the quantization puts into
the attention map (docs/design.md §6, "Protocol details")."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffjax import checks, kernels
from diffjax.config import Config, ConfigError, ModelConfig
from diffjax.data.pipeline import validation_iterator
from diffjax.eval import Protocol, progress, register, table
from diffjax.eval.retrieval import applies as has_retrieval
from diffjax.eval.retrieval import retrieval_accuracy
from diffjax.kernels import quantized, reference
from diffjax.model import archs, sown_per_layer
from diffjax.train.step import token_losses

NONE_BITS = 16  # the paper's unquantized configuration
ERRORS = ("map_error", "output_error", "softmax_error")  # relative errors per layer (`map_errors`)


def quantized_impl(bits: int, granularity: str, shared_scale: bool = False) -> str:
    """Register (idempotently) the kernel impl quantizing logits to `bits` bits at `granularity` (DIFF's two maps
    by one scale with `shared_scale`); its name."""
    if granularity not in quantized.GRANULARITIES:
        raise ConfigError(f"eval.granularity: choose one of {quantized.GRANULARITIES}, got {granularity!r}")
    name = f"xla_q{bits}_{granularity}{'_shared' if shared_scale else ''}"
    if name not in kernels.names():
        kw = {"bits": bits, "granularity": granularity, "shared_scale": shared_scale}
        kernels.register(name, attention=functools.partial(quantized.attention, **kw),
                         diff_attention=functools.partial(quantized.diff_attention, **kw), features=("sinks",))
    return name


def quantized_config(cfg: Config, bits: int, granularity: str, shared_scale: bool = False) -> Config:
    """`cfg` with its attention logits quantized to `bits` bits (`cfg` itself at 16 bits)."""
    if bits == NONE_BITS:
        return cfg
    model = dataclasses.replace(cfg.model, attention_impl=quantized_impl(bits, granularity, shared_scale))
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


@functools.partial(jax.jit, static_argnames=("cfg", "bits", "granularity", "shared_scale"))
def _map_error_sums(cfg: ModelConfig, params, batch, bits: tuple[int, ...], granularity: str, shared_scale: bool):
    """[bits, layers, 6]: Σ‖Q(P) − P‖², Σ‖P‖² of the effective map P, Σ‖(Q(P) − P) V‖², Σ‖P V‖² of the heads it
    makes (nan where the arch declares no way to combine its maps), Σ‖Q(A) − A‖², Σ‖A‖² over its softmax maps A, over
    the real query rows of `batch`; and [layers] λ's mean (nan without λ). Every layer is quantized at its exact
    inputs: its own error, none carried from below."""
    arch = archs.get(cfg.arch)
    seg = batch["segment_ids"]
    b, t = seg.shape
    mask = reference.make_mask(b, t, t, causal=True, segment_ids=seg)
    real = seg > 0
    sq = lambda x: jnp.sum(jnp.where(real[:, None, :, None], jnp.square(x), 0.0))  # noqa: E731  [B, H, T, ·]
    sums, lams = [], []
    for layer in sown_per_layer(cfg, params, batch["tokens"], batch["positions"], seg):
        sown = layer["attn"]
        logits = arch.attention_logits(cfg, sown, mask)
        exact = {name: reference.softmax(x, sown.get("sinks")) for name, x in logits.items()}
        p = arch.combined(sown, exact)
        if p is not None:
            v = sown["v"].astype(jnp.float32)
            v = jnp.repeat(v, p.shape[1] // v.shape[2], axis=2)
            heads = lambda m, v=v: jnp.einsum("bhts,bshe->bhte", m, v)  # noqa: E731
        per_bits = []
        for width in bits:
            q = _quantized_maps(arch, logits, mask, sown.get("sinks"), bits=width, granularity=granularity,
                                shared_scale=shared_scale)
            nan = jnp.float32(jnp.nan)
            if p is None:
                effective = [nan] * 4
            else:
                error = arch.combined(sown, q) - p
                effective = [sq(error), sq(p), sq(heads(error)), sq(heads(p))]
            per_bits.append(jnp.stack([*effective, sum(sq(q[n] - exact[n]) for n in q),
                                       sum(sq(a) for a in exact.values())]))
        sums.append(jnp.stack(per_bits))
        lams.append(jnp.mean(sown["lambda"]) if "lambda" in sown else jnp.float32(jnp.nan))
    return jnp.stack(sums, 1), jnp.stack(lams)


def _quantized_maps(arch: archs.Arch, logits: dict, mask, sinks, **options) -> dict:
    """The softmax maps as the quantized op computes them: the maps of one "attention" call (DIFF V2's pairs) sit on
    its head axis, so a per-tensor scale spans them all; "diff_attention" takes its two maps apart (`shared_scale`)."""
    if "diff_attention" not in arch.ops and len(logits) > 1:
        joint = jnp.concatenate(list(logits.values()), axis=1)
        [p] = quantized.quantized_softmax([joint], mask, **options | {"shared_scale": False}, sinks=sinks)
        return dict(zip(logits, jnp.split(p, len(logits), axis=1), strict=True))
    return dict(zip(logits, quantized.quantized_softmax(list(logits.values()), mask, **options, sinks=sinks),
                    strict=True))


def map_errors(cfg: Config, params, batches: list[dict], bits: tuple[int, ...], granularity: str,
               shared_scale: bool) -> dict:
    """Per bit width, per layer (`ERRORS`): ‖Q(P) − P‖ / ‖P‖ of the effective map P (DIFF's A1 − λA2; null where the
    arch declares none), ‖(Q(P) − P) V‖ / ‖P V‖ of the heads it makes (what a head norm scales back up) and
    ‖Q(A) − A‖ / ‖A‖ over its softmax maps; and each layer's mean λ (null without one)."""
    quantized_bits = tuple(b for b in bits if b != NONE_BITS)
    sums, lam = 0.0, None
    for batch in batches:
        s, lam = jax.device_get(_map_error_sums(cfg.model, params, batch, quantized_bits, granularity, shared_scale))
        sums = sums + s.astype(np.float64)
    by_bits = dict(zip(quantized_bits, np.sqrt(sums[..., 0::2] / sums[..., 1::2]), strict=True))
    zeros = np.zeros((cfg.model.n_layers, 3))
    errors = [by_bits.get(b, zeros) for b in bits]
    finite = lambda x: [None if np.isnan(v) else float(v) for v in x]  # noqa: E731
    return {name: [finite(e[:, i]) for e in errors] for i, name in enumerate(ERRORS)} | {"lambda": finite(lam)}


def quantization(cfg: Config, params, *, bits: tuple[int, ...] = (16, 8, 6, 4), granularity: str = "tensor",
                 shared_scale: bool = False, eval_batches: int = 0, retrieval_n: int = 32,
                 seed: int | None = None) -> dict:
    """{"bits": [...], "val_loss": [per width], "retrieval_accuracy": [per width] (retrieval data only),
    ERRORS: [per width][per layer], "lambda": [per layer], ...}."""
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
    result: dict = {"bits": [int(b) for b in bits], "granularity": granularity, "shared_scale": shared_scale,
                    "eval_batches": n_batches, "val_loss": []}
    if retrieval:
        result |= {"retrieval_n": retrieval_n, "retrieval_accuracy": [], "retrieval_by_depth": []}
    for b in progress(bits, "quantization"):
        run_cfg = quantized_config(cfg, b, granularity, shared_scale)
        result["val_loss"].append(validation_loss(run_cfg, params, batches))
        if retrieval:
            acc = retrieval_accuracy(run_cfg, params, n=retrieval_n, seed=seed)
            result["retrieval_accuracy"].append(acc["mean"])
            result["retrieval_by_depth"].append({str(d): a for d, a in acc["by_depth"].items()})
    return result | map_errors(cfg, params, batches, tuple(bits), granularity, shared_scale)


def _metrics(results: dict[str, dict]) -> list[tuple[str, str]]:
    metrics = [("val_loss", "val loss")]
    if all("retrieval_accuracy" in r for r in results.values()):
        metrics.append(("retrieval_accuracy", "retrieval acc."))
    return metrics


def markdown(results: dict[str, dict]) -> str:
    metrics = _metrics(results)
    widths = sorted({b for r in results.values() for b in r["bits"]}, reverse=True)
    rows = []
    for b in widths:
        cells = [f"{r[key][r['bits'].index(b)]:.4f}" if b in r["bits"] else "–" for r in results.values()
                 for key, _ in metrics]
        rows.append([f"{b}{' (none)' if b == NONE_BITS else ''}", *cells])
    granularity = ", ".join(sorted({r["granularity"] for r in results.values()}))
    shared = ", one scale for both maps of a DIFF head" if any(r.get("shared_scale") for r in results.values()) else ""
    return (f"Attention-logit quantization (paper §3.7, Fig. 8), absmax per {granularity}{shared}\n\n"
            + table(["bits", *(f"{label} {name}" for label in results for _, name in metrics)], rows) + "\n")


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
    """Every run whose arch calls a kernel op (`Arch.op`), for the quantized impl to stand in for: such an arch
    computes each softmax map in an op, so the op's q kᵀ/√d are its `Arch.attention_logits`, quantized per map."""
    return archs.get(cfg.model.arch).op is not None


register(Protocol("quantization", quantization, applies, markdown=markdown, plot=plot))

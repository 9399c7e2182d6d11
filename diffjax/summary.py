"""`diffjax summary`: what a config builds — parameter counts, the DIFF model an arch is matched to, λ_init, training
FLOPs per token, and the kernel each attention op resolves to on each platform."""

from __future__ import annotations

from diffjax import kernels, recipes
from diffjax.config import Config
from diffjax.flops import train_flops_per_token
from diffjax.model import archs, lambda_inits, param_count


def summary(cfg: Config) -> dict:
    m = cfg.model
    counts = param_count(m)
    twin = recipes.diff_twin(m)  # the DIFF model this arch's shape is matched to in parameters (docs/design.md §2)
    matched = {} if twin is None else {"matched_to": (
        f"diff with {twin.n_heads} heads of {twin.head_dim} ({param_count(twin)['params']:,} parameters): this "
        f"{m.arch} has {m.n_heads} heads of {m.head_dim}, {counts['params'] / param_count(twin)['params'] - 1:+.2%}")}
    return {"name": cfg.name, "arch": m.arch, **counts, **matched,
            # float32 values shown as the decimals they are meant to be (0.2, not 0.19999998807907104)
            "lambda_init": [float(f"{x:.6g}") for x in lambda_inits(m)] if archs.get(m.arch).has_lambda_init else [],
            "flops_per_token": train_flops_per_token(m, cfg.data.seq_len),
            # what each attention op resolves to per platform (with mesh.context > 1: per block of the split)
            "attention_kernel": {p: attention_kernel(cfg, p) for p in ("cpu", "gpu", "tpu")}}


def attention_kernel(cfg: Config, platform: str) -> str:
    """`op: impl` for each kernel op the arch calls, comma-separated."""
    m, arch, split = cfg.model, archs.get(cfg.model.arch), cfg.mesh.context > 1
    if not arch.ops:
        return f"none: {m.arch} computes its attention itself (XLA)"
    impls = {op: kernels.choice(m.attention_impl, op, platform, m.dtype, arch.op_features, split) for op in arch.ops}
    label = f"({m.context_strategy} over context)"  # with mesh.context > 1: what computes a block of the split
    return ", ".join(f"{op}: {kernels.split_label(impl, label) if split else impl}" for op, impl in impls.items())


NOTES = {"params": " (every parameter, the embedding and the output matrices both)",  # what each count counts
         "params_embedding": " (the embedding and output matrices)",
         "params_paper": " (one embedding matrix, as the paper's size names count: docs/design.md §2, \"Paper "
                         "configurations\")"}


def describe(info: dict) -> str:
    """`summary(cfg)` as aligned `key: value` lines, each count saying what it counts."""
    lines = []
    for k, v in info.items():
        if isinstance(v, int):
            v = f"{v:,}"
        elif k == "lambda_init":
            v = " / ".join(f"{x:g}" for x in v) + " (layers 1 … L)" if v else "none (this arch has no λ_init)"
        elif k == "flops_per_token":
            v = f"{v:.4g} (training: forward and backward, per token at data.seq_len)"
        lines.append(f"{k:>18}: {v}{NOTES.get(k, '')}")
    return "\n".join(lines)

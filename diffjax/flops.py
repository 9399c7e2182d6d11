"""Training FLOPs, counted algorithmically (DESIGN §4), for throughput and MFU.

Matmuls cost 2 FLOPs per multiply-add; training costs 3× the forward for weights (forward + two backward
matmuls). Attention is counted per DESIGN §4 in units of h·N²·d (h DIFF heads of dim d, N tokens,
non-causal): standard attention with 2h heads of d costs forward 8, backward 20; fused DIFF attention
forward 12, backward 20. Causal masking halves both.
"""

from __future__ import annotations

from diffjax.config import ModelConfig


def attention_flops(arch: str, n_heads: int, head_dim: int, seq_len: int, *, causal: bool = True,
                    backward: bool = True) -> float:
    """FLOPs of one attention call on one sequence of `seq_len` tokens.

    `n_heads` is the arch's own head count: ordinary heads for "transformer", DIFF heads h for "diff",
    output heads h for "diff_v2" (whose attention runs over 2h query heads of d).
    """
    if arch == "diff":
        fwd, bwd = 12.0, 20.0
        h = n_heads
    else:  # standard attention over H query heads of d is 4·H·N²·d forward = 8 units of (H/2)·N²·d
        fwd, bwd = 8.0, 20.0
        h = n_heads if arch == "diff_v2" else n_heads / 2
    units = fwd + (bwd if backward else 0.0)
    return units * h * seq_len**2 * head_dim * (0.5 if causal else 1.0)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: all projections and the output layer
    (the input embedding is a lookup; norms and λ vectors are elementwise)."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.resolved_ffn_dim
    if cfg.arch == "diff":
        attn = d * 2 * h * hd + 2 * (d * 2 * kv * hd) + 2 * h * hd * d
    elif cfg.arch == "diff_v2":
        attn = d * 2 * h * hd + 2 * (d * kv * hd) + h * hd * d + d * h
    else:
        attn = d * h * hd + 2 * (d * kv * hd) + h * hd * d
    return cfg.n_layers * (attn + 3 * d * f) + cfg.vocab_size * d


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token at sequence length `seq_len` (causal)."""
    attn = cfg.n_layers * attention_flops(cfg.arch, cfg.n_heads, cfg.head_dim, seq_len) / seq_len
    return 6.0 * matmul_params(cfg) + attn

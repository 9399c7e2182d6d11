"""Training FLOPs, counted algorithmically, for throughput and MFU (docs/design.md, "FLOPs").

Matmuls cost 2 FLOPs per multiply-add; training costs 3× the forward for weights (forward + two backward
matmuls). Attention is counted by each architecture (`Arch.attention_flops`) in units of h·N²·d (h DIFF heads of
dim d, N tokens, non-causal): standard attention with 2h heads of d costs forward 8, backward 20; fused DIFF
attention forward 12, backward 20. Causal masking halves both.
"""

from __future__ import annotations

from diffjax.config import ModelConfig
from diffjax.model import archs


def attention_flops(cfg: ModelConfig, seq_len: int, *, causal: bool = True, backward: bool = True) -> float:
    """FLOPs of one attention call of `cfg`'s arch on one sequence of `seq_len` tokens."""
    return archs.get(cfg.arch).attention_flops(cfg, seq_len, causal, backward)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: all projections and the output layer
    (the input embedding is a lookup; norms and λ vectors are elementwise)."""
    attn = archs.get(cfg.arch).attention_params(cfg)
    return cfg.n_layers * (attn + 3 * cfg.d_model * cfg.resolved_ffn_dim) + cfg.vocab_size * cfg.d_model


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token at sequence length `seq_len` (causal)."""
    return 6.0 * matmul_params(cfg) + cfg.n_layers * attention_flops(cfg, seq_len) / seq_len

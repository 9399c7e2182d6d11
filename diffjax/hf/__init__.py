"""Hugging Face checkpoints in and out: `load_pretrained(path)` and `save_pretrained(cfg, params, path)`.

DIFF ↔ `DiffLlamaForCausalLM`, Transformer ↔ `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM` (the mapping: docs/design.md, "Hugging Face").
"""

from diffjax.hf.checkpoint import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]

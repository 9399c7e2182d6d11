"""`diffjax generate`: text sampled from a run's latest checkpoint with the KV cache (`model.generate`); one prompt
streams (`Stream`), several print whole in order (`InOrder`). The run directory is only read."""

from __future__ import annotations

import sys
from pathlib import Path

from diffjax import paths
from diffjax.config import ConfigError
from diffjax.data.tokenizer import get_tokenizer
from diffjax.model.generate import Sampling, check_prompts, encode_prompt, generate
from diffjax.train import run_config
from diffjax.train.run_loader import load_run

INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of a character still to come


def read_prompts(path) -> list[str]:
    """The non-blank lines of a file, one prompt each."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {path}: holds no prompt (one a line)")
    return prompts


class Stream:
    """One prompt's continuation, written as its tokens arrive; a character whose bytes span several tokens waits for
    its last byte."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.written = tokenizer, out, 0

    def on_token(self, i: int, new: list[int], final: bool = False) -> None:
        text = self.tokenizer.decode(new)
        if not final:
            text = text.rstrip(INCOMPLETE)
        self.out.write(text[self.written:])
        self.out.flush()
        self.written = max(self.written, len(text))

    def on_done(self, i: int, new: list[int]) -> None:
        self.on_token(i, new, final=True)
        self.out.write("\n")


class InOrder:
    """Several prompts, each written whole with its continuation under a header, in their order: a finished prompt
    waits for those before it."""

    on_token = None

    def __init__(self, tokenizer, prompts: list[str], out):
        self.tokenizer, self.prompts, self.out = tokenizer, prompts, out
        self.finished, self.written = {}, 0

    def on_done(self, i: int, new: list[int]) -> None:
        self.finished[i] = new
        while self.written in self.finished:
            n, self.written = self.written, self.written + 1
            text = self.tokenizer.decode(self.finished.pop(n))
            self.out.write(f"=== prompt {n + 1}/{len(self.prompts)} ===\n{self.prompts[n]}{text}\n")
            self.out.flush()


def run(workdir, prompts: list[str], *, max_new_tokens: int, sampling: Sampling, seed: int = 0,
        batch_size: int = 8, out=None) -> list[str]:
    """Print each prompt and its continuation on `out` (default stdout); return the continuations."""
    out = out or sys.stdout
    cfg = run_config.load(paths.run_dir(workdir))
    tokenizer = get_tokenizer(cfg.data.tokenizer)  # a loaded run's: its own copy
    ids = [encode_prompt(tokenizer, text) for text in prompts]
    context = cfg.data.seq_len  # the longest sequence the model was trained on (an imported run: set at import)
    check_prompts(ids, max_new_tokens=max_new_tokens, max_len=context, vocab_size=cfg.model.vocab_size)
    cfg, params, mesh = load_run(workdir, params_only=True)
    if len(prompts) == 1:
        out.write(prompts[0])
        printer = Stream(tokenizer, out)
    else:
        printer = InOrder(tokenizer, prompts, out)
    generated = generate(cfg.model, params, ids, max_new_tokens=max_new_tokens, max_len=context,
                         eos_id=tokenizer.eos_id, sampling=sampling, seed=seed, batch_size=batch_size, mesh=mesh,
                         on_token=printer.on_token, on_done=printer.on_done)
    return [tokenizer.decode(new) for new in generated]

"""Sampling from a decoder LM with its KV cache, prompts of different lengths in one batch: left-padded to a bucket
length, each row's start recorded in the cache (`init_cache(start=...)`), so a prompt decodes as it would alone and
the decode step compiles once (docs/hf.md). Warpers in transformers' order: temperature, top-k, top-p; each prompt
draws from `fold_in(key(seed), prompt index)` folded with the step."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import ConfigError, ModelConfig
from diffjax.model import decode_step, init_cache

MIN_BUCKET = 32


def bucket(n: int) -> int:
    """The padded length of n tokens: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << math.ceil(math.log2(max(n, 1))))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn (transformers' meanings): temperature 0 is greedy; top_k 0 and top_p 1 keep
    every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (1: every token), got {self.top_p}")


def top_k_mask(logits, k: int):
    """[..., V] bool: the tokens top-k sampling keeps, those at least as large as the k-th largest (its ties kept,
    as transformers' TopKLogitsWarper); k = 0 keeps all."""
    if k == 0 or k >= logits.shape[-1]:
        return jnp.ones(logits.shape, bool)
    return logits >= jax.lax.top_k(logits, k)[0][..., -1:]


def top_p_mask(logits, p: float):
    """[..., V] bool: the tokens nucleus sampling keeps, as transformers' TopPLogitsWarper: in ascending order a token
    is dropped while the probability up to and including it is at most 1 − p; the most probable is always kept."""
    order = jnp.argsort(logits, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    drop = (jnp.cumsum(probs, axis=-1) <= 1 - p).at[..., -1].set(False)
    return ~jnp.take_along_axis(drop, jnp.argsort(order, axis=-1), axis=-1)


def sample(logits, keys, sampling: Sampling):
    """The next token of each row, [B] int32, from float32 logits [B, V] and one key per row."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / sampling.temperature
    scaled = jnp.where(top_k_mask(scaled, sampling.top_k), scaled, -jnp.inf)
    if sampling.top_p < 1:
        scaled = jnp.where(top_p_mask(scaled, sampling.top_p), scaled, -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames="cache")
def _advance(cfg: ModelConfig, sampling: Sampling, params, cache, tokens, keys, step):
    """Append tokens [B, T] to the cache and draw the next token of each row: ([B, 1] int32, cache)."""
    logits, cache = decode_step(cfg, params, cache, tokens, last_only=True)
    step_keys = jax.vmap(lambda key: jax.random.fold_in(key, step))(keys)
    return sample(logits[:, 0], step_keys, sampling)[:, None], cache


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's ids; an empty prompt is the end-of-text id (what starts every document)."""
    return tokenizer.encode(text) or [tokenizer.eos_id]


def check_prompts(prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_len: int, vocab_size: int) -> None:
    """ConfigError unless every prompt is non-empty, in the vocabulary, and fits the context with the new tokens."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, ids in enumerate(prompts):
        if not len(ids):
            raise ConfigError(f"prompt {i + 1} is empty (start from the end-of-text id to sample unconditioned)")
        if len(ids) + max_new_tokens > max_len:
            raise ConfigError(f"prompt {i + 1} has {len(ids)} tokens: with {max_new_tokens} new ones that is "
                              f"{len(ids) + max_new_tokens}, more than the model's context of {max_len} tokens")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ConfigError(f"prompt {i + 1} holds token ids outside the model's vocabulary of {vocab_size}")


def left_pad(prompts: Sequence[Sequence[int]], room: int):
    """(tokens [n, width] int32, starts [n]): the prompts at the right end of their bucket's width (at most `room`)."""
    width = min(bucket(max(map(len, prompts))), room)
    tokens = np.zeros((len(prompts), width), np.int32)
    for r, ids in enumerate(prompts):
        tokens[r, width - len(ids):] = ids
    return tokens, [width - len(ids) for ids in prompts]


def generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_len: int,
             eos_id: int | None, sampling: Sampling = Sampling(), seed: int = 0, batch_size: int = 8, mesh=None,
             on_token: Callable[[int, list[int]], bool | None] | None = None,
             on_done: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
    """The new token ids of each prompt, up to `max_new_tokens`, without the end-of-text id; `max_len`: the model's
    context. `on_token(i, ids)` after each of prompt i's tokens (True: stop it there); `on_done(i, ids)` once."""
    check_prompts(prompts, max_new_tokens=max_new_tokens, max_len=max_len, vocab_size=cfg.vocab_size)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    generated = [[] for _ in prompts]
    if not prompts:
        return generated
    rows = min(batch_size, len(prompts))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        for first in range(0, len(prompts), rows):
            batch = list(range(first, min(first + rows, len(prompts))))
            batch += batch[:1] * (rows - len(batch))  # a short last batch repeats a prompt (its output unused)
            tokens, starts = left_pad([prompts[i] for i in batch], max_len - max_new_tokens)
            cache = init_cache(cfg, rows, max_len, start=starts)
            keys = jax.vmap(functools.partial(jax.random.fold_in, jax.random.key(seed)))(jnp.asarray(batch))
            nxt, cache = _advance(cfg, sampling, params, cache, tokens, keys, 0)
            live = dict.fromkeys(range(min(rows, len(prompts) - first)))  # the rows still decoding, in order
            for step in range(1, max_new_tokens + 1):
                current = nxt
                if step < max_new_tokens:  # dispatched before waiting on `current`: the device runs ahead
                    nxt, cache = _advance(cfg, sampling, params, cache, current, keys, step)
                current = np.asarray(current)[:, 0]
                for r in list(live):
                    i, token = batch[r], int(current[r])
                    stop = token == eos_id
                    if not stop:
                        generated[i].append(token)
                        stop = bool(on_token and on_token(i, generated[i]))
                    if stop or step == max_new_tokens:
                        del live[r]
                        if on_done:
                            on_done(i, generated[i])
                if not live:
                    break
    return generated

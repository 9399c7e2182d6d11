"""lm-evaluation-harness on a diffjax model: `DiffjaxLM` (loglikelihood, loglikelihood_rolling, generate_until)
and `evaluate(workdir, tasks, ...)` driving `lm_eval.simple_evaluate`.

Requests are batched and padded to a few shapes: batch rows to `batch_size`, lengths to powers of two (from 32),
so a task compiles a handful of programs, not one per request. Right padding is exact for scoring (causal
attention: padding after a token cannot change its logits). Generation is greedy with the KV cache; rows of a
batch share one cache index, so a batch holds prompts of one length (prefilled in chunks of `PREFILL` tokens, the
remainder one token at a time). Under a multi-device mesh the jitted calls run inside it (`jax.set_mesh`), as
the train and eval steps do.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import ConfigError
from diffjax.model import DecoderLM, decode_step, init_cache

try:
    from lm_eval.api.model import LM
except ImportError:  # the optional extra: `pip install diffjax[eval]`
    LM = object

PREFILL, MIN_BUCKET = 32, 32


def bucket(n: int) -> int:
    return max(MIN_BUCKET, 1 << math.ceil(math.log2(max(n, 1))))


class DiffjaxLM(LM):
    def __init__(self, model_cfg, params, tokenizer, *, mesh=None, batch_size: int = 8, max_length: int = 1024):
        if LM is object:
            raise ConfigError("diffjax lm-eval needs lm-evaluation-harness: pip install 'diffjax[eval]'")
        super().__init__()
        self.cfg, self.params, self.tok, self.mesh = model_cfg, params, tokenizer, mesh
        self.batch_size, self.max_length = batch_size, max_length
        self.eot = tokenizer.eos_id
        self._score = jax.jit(functools.partial(_score, model_cfg))
        self._step = jax.jit(functools.partial(decode_step, model_cfg))

    def _run(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh):
            return fn(*args)

    # scoring ---------------------------------------------------------------------------------------------
    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(Σ log p(continuation | context), continuation is the greedy one) for (context, continuation) ids."""
        rows = []
        for ctx, cont in pairs:
            whole = (ctx + cont)[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], min(len(cont), len(whole) - 1)))
        out = [None] * len(rows)
        by_len = defaultdict(list)
        for i, (inp, _, _) in enumerate(rows):
            by_len[bucket(len(inp))].append(i)
        for length, idx in sorted(by_len.items()):
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start:start + self.batch_size]
                tokens = np.zeros((self.batch_size, length), np.int32)
                targets, mask = np.zeros_like(tokens), np.zeros(tokens.shape, bool)
                for r, i in enumerate(chunk):
                    inp, tgt, n = rows[i]
                    tokens[r, :len(inp)], targets[r, :len(tgt)] = inp, tgt
                    mask[r, len(tgt) - n:len(tgt)] = True
                logp, greedy = jax.device_get(self._run(self._score, self.params, tokens, targets, mask))
                for r, i in enumerate(chunk):
                    out[i] = (float(logp[r]), bool(greedy[r]))
        return out

    def _encode_pair(self, context: str, continuation: str):
        spaces = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation (as HFLM)
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.tok.encode(context) if context else [self.eot]
        return ctx, self.tok.encode(continuation)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self.score_pairs([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for n, r in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok.encode(r.args[0]), prefix_token=self.eot,
                                                max_seq_len=self.max_length, context_len=1)
            for w in map(make_disjoint_window, windows):
                pairs.append((list(w[0]), list(w[1])))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self.score_pairs(pairs), strict=True):
            totals[n] += logp
        return totals

    # generation -------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False):
        out = [None] * len(requests)
        groups = defaultdict(list)
        for i, r in enumerate(requests):
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = (self.tok.encode(context) or [self.eot])[-(self.max_length - max_new):]
            groups[(len(ids), max_new)].append((i, ids, until))
        for (_, max_new), items in sorted(groups.items()):
            for start in range(0, len(items), self.batch_size):
                chunk = items[start:start + self.batch_size]
                texts = self._greedy([ids for _, ids, _ in chunk], max_new, [u for _, _, u in chunk])
                for (i, _, _), text in zip(chunk, texts, strict=True):
                    out[i] = text
        return out

    def _greedy(self, prompts: list[list[int]], max_new: int, untils: list[list[str]]) -> list[str]:
        n, length = len(prompts), len(prompts[0])
        tokens = np.array(prompts + [prompts[0]] * (self.batch_size - n), np.int32)  # pad rows repeat row 0
        cache = init_cache(self.cfg, self.batch_size, bucket(length + max_new))
        full = length - length % PREFILL
        logits = None
        for s in range(0, full, PREFILL):
            logits, cache = self._run(self._step, self.params, cache, tokens[:, s:s + PREFILL])
        for s in range(full, length):
            logits, cache = self._run(self._step, self.params, cache, tokens[:, s:s + 1])
        generated = [[] for _ in range(n)]
        done = [False] * n
        for _ in range(max_new):
            nxt = np.asarray(jnp.argmax(logits[:, -1], -1), np.int32)
            for r in range(n):
                if not done[r]:
                    generated[r].append(int(nxt[r]))
                    text = self.tok.decode(generated[r])
                    done[r] = int(nxt[r]) == self.eot or any(u in text for u in untils[r])
            if all(done):
                break
            logits, cache = self._run(self._step, self.params, cache, nxt[:, None])
        texts = []
        for r in range(n):
            text = self.tok.decode(t for t in generated[r] if t != self.eot)
            for u in untils[r]:
                text = text.split(u)[0]
            texts.append(text)
        return texts


def _score(cfg, params, tokens, targets, mask):
    logits = DecoderLM(cfg).apply({"params": params}, tokens)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    greedy = jnp.argmax(logits, -1) == targets
    return jnp.sum(jnp.where(mask, logp, 0.0), -1), jnp.all(greedy | ~mask, -1)


def evaluate(workdir, tasks: list[str], *, num_fewshot: int | None = None, limit: float | None = None,
             include_path: str | None = None, batch_size: int = 8, max_length: int | None = None,
             log_samples: bool = False) -> dict:
    """lm_eval.simple_evaluate on run `workdir`'s latest checkpoint; returns lm-eval's results dict."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError("diffjax lm-eval needs lm-evaluation-harness: pip install 'diffjax[eval]'") from e
    from diffjax.data.tokenizer import get_tokenizer
    from diffjax.train.loop import load_run

    cfg, state, mesh = load_run(workdir)
    manager = None
    if include_path:  # indexing lm-eval's own ~10k task files takes seconds: skip it when the local ones suffice
        manager = TaskManager(include_path=include_path, include_defaults=False)
        manager = manager if all(t in manager.all_tasks for t in tasks) else None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks: unknown lm-eval task(s) {unknown} (a local task needs --include PATH)")
    lm = DiffjaxLM(cfg.model, state.params, get_tokenizer(cfg.data.tokenizer), mesh=mesh, batch_size=batch_size,
                   max_length=max_length or cfg.data.seq_len)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples)

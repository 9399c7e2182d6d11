"""lm-evaluation-harness on a diffjax model: `DiffjaxLM` (scoring right-padded to a few shapes, greedy generation
on the KV cache; docs/design.md §6) and `evaluate(workdir, tasks, ...)` driving `lm_eval.simple_evaluate`."""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config import ConfigError
from diffjax.model import DecoderLM
from diffjax.model.generate import bucket, encode_prompt, generate

try:
    from lm_eval.api.model import LM
except ImportError:  # the optional extra: `pip install diffjax[eval]`
    LM = object

class DiffjaxLM(LM):
    def __init__(self, model_cfg, params, tokenizer, *, mesh=None, batch_size: int = 8, max_length: int = 1024):
        if LM is object:
            raise ConfigError("diffjax lm-eval needs lm-evaluation-harness: pip install 'diffjax[eval]'")
        super().__init__()
        self.cfg, self.params, self.tok, self.mesh = model_cfg, params, tokenizer, mesh
        self.batch_size, self.max_length = batch_size, max_length
        self.eot = tokenizer.eos_id
        # what an empty context and each rolling window start from: as lm-eval's HF backend, the tokenizer's BOS
        # where it has one (a pretrained Llama's documents start with it), else the end of text (diffjax's own)
        self.prefix = self.eot if tokenizer.bos_id is None else tokenizer.bos_id
        self._score = jax.jit(functools.partial(_score, model_cfg))

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
                with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                    logp, greedy = jax.device_get(self._score(self.params, tokens, targets, mask))
                for r, i in enumerate(chunk):
                    out[i] = (float(logp[r]), bool(greedy[r]))
        return out

    def _encode_pair(self, context: str, continuation: str):
        """(context ids, continuation ids) as lm-eval's HF backend makes them: the default encoding (BOS included) of
        the whole, split after the context's; an empty context is the prefix token."""
        spaces = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            cont = self.tok.encode(continuation)
            return ([self.prefix], cont) if cont[:1] != [self.prefix] else (cont[:1], cont[1:])
        whole, ctx = self.tok.encode_with_specials(context + continuation), self.tok.encode_with_specials(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self.score_pairs([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for n, r in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok.encode_with_specials(r.args[0]),
                                                prefix_token=self.prefix, max_seq_len=self.max_length, context_len=1)
            for w in map(make_disjoint_window, windows):
                pairs.append((list(w[0]), list(w[1])))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self.score_pairs(pairs), strict=True):
            totals[n] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = [None] * len(requests)
        groups = defaultdict(list)  # one generate() per max_gen_toks, its prompts by length (less padding)
        for i, r in enumerate(requests):
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            groups[max_new].append((i, encode_prompt(self.tok, context)[-(self.max_length - max_new):], until))
        for max_new, items in sorted(groups.items()):
            items.sort(key=lambda item: len(item[1]))
            generated = generate(self.cfg, self.params, [ids for _, ids, _ in items], max_new_tokens=max_new,
                                 max_len=self.max_length, eos_id=self.eot, batch_size=self.batch_size,
                                 mesh=self.mesh, on_token=self._stop_strings([until for _, _, until in items]))
            for (i, _, until), new in zip(items, generated, strict=True):
                text = self.tok.decode(new)
                for u in until:
                    text = text.split(u)[0]
                out[i] = text
        return out

    def _stop_strings(self, untils: list[list[str]]):
        """generate()'s `on_token`: prompt n stops once its text holds one of its stop strings `untils[n]`."""
        return lambda n, new: any(u in self.tok.decode(new) for u in untils[n])


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
    from diffjax.train.run_loader import load_run

    cfg, params, mesh = load_run(workdir, params_only=True)
    manager = None
    if include_path:  # indexing lm-eval's own ~10k task files takes seconds: skip it when the local ones suffice
        manager = TaskManager(include_path=include_path, include_defaults=False)
        manager = manager if all(t in manager.all_tasks for t in tasks) else None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks: unknown lm-eval task(s) {unknown} (a local task needs --include PATH)")
    lm = DiffjaxLM(cfg.model, params, get_tokenizer(cfg.data.tokenizer), mesh=mesh, batch_size=batch_size,
                   max_length=max_length or cfg.data.seq_len)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples)

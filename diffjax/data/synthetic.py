"""Synthetic tasks (docs/design.md §5): multi-needle retrieval (paper §3.4) and multi-query associative recall.

Every example is exactly `seq_len + 1` tokens, a pure function of (seed, split salt, index); `loss_mask[t]` says
whether `targets[t] = sequence[t + 1]` is trained: the answer tokens only. Retrieval: N needles "The magic number of
<city> is <7-digit number>." among filler sentences, then R questions "What is the magic number of <city>? The magic
number of <city> is <number>"; the first queried needle sits at the requested depth of the context (0 = first token,
1 = just before the questions) snapped to a sentence boundary, the others at random boundaries. MQAR (Zoology, Arora
et al. 2023): D key-value pairs `k1 v1 … kD vD` from disjoint id ranges, then Q `k v` queries at random slots among
noise ids from a third range.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffjax.data.sources import DataError
from diffjax.data.tokenizer import get_tokenizer

TASKS = ("retrieval", "mqar")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SALTS = {"train": 0, "val": 1, "eval": 2}
SOURCE_LEN = 2**31 - 1  # examples are generated on demand; this only bounds the index

CITIES = (
    "Tokyo", "Delhi", "Shanghai", "Cairo", "Mumbai", "Beijing", "Dhaka", "Osaka", "Karachi", "Istanbul",
    "Lagos", "Manila", "Moscow", "Paris", "London", "Lima", "Bangkok", "Seoul", "Madrid", "Berlin",
    "Rome", "Athens", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo", "Stockholm", "Helsinki",
    "Copenhagen", "Amsterdam", "Brussels", "Zurich", "Geneva", "Munich", "Milan", "Naples", "Venice", "Florence",
    "Boston", "Chicago", "Denver", "Seattle", "Houston", "Dallas", "Miami", "Atlanta", "Phoenix", "Toronto",
    "Montreal", "Vancouver", "Sydney", "Melbourne", "Perth", "Auckland", "Nairobi", "Accra", "Dakar", "Tunis",
    "Havana", "Bogota", "Quito", "Santiago", "Caracas", "Hanoi", "Jakarta", "Taipei", "Kyoto", "Riyadh",
)
MAX_NEEDLES = len(CITIES)  # every needle names a distinct city
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river is wide.", "The road is long.", "The night is dark.", "Snow is white.", "The sea is deep.",
    "Birds can fly.", "The wind is cold.", "Trees are tall.", "The stone is grey.", "Fire is hot.",
)
MQAR_OFFSET = 32  # key ids start here; keys, values and noise are three consecutive ranges of mqar_vocab ids


def example_rng(seed: int, salt: int, index: int, *extra: int) -> np.random.Generator:
    # SeedSequence hashes the whole tuple, so neighbouring indices give independent streams.
    return np.random.default_rng([seed, salt, index, *extra])


@dataclasses.dataclass
class Example:
    sequence: np.ndarray  # int32 [seq_len + 1]
    loss_mask: np.ndarray  # float32 [seq_len]: 1 where targets = sequence[1:] is an answer token
    info: dict = dataclasses.field(default_factory=dict)


class RetrievalTask:
    def __init__(self, tokenizer, seq_len: int, n_needles: int, n_query_cities: int):
        if not 1 <= n_query_cities <= n_needles <= len(CITIES):
            raise DataError(f"retrieval: need 1 <= n_query_cities ({n_query_cities}) <= n_needles ({n_needles}) "
                            f"<= {len(CITIES)}")
        self.tok, self.length = tokenizer, seq_len + 1
        self.n_needles, self.n_query = n_needles, n_query_cities
        # A leading space makes separately encoded sentences concatenate exactly as the joined text would.
        self._filler = [np.asarray(tokenizer.encode(" " + s), np.int32) for s in FILLER]
        self._dot = np.asarray(tokenizer.encode("."), np.int32)
        longest = max(CITIES, key=len)
        worst = (n_needles * len(self._needle(longest, 9_999_999))
                 + n_query_cities * (len(self._question(longest)) + len(self._answer(9_999_999)) + 1))
        if worst > self.length:
            raise DataError(f"retrieval: seq_len {seq_len} is too short for {n_needles} needles and "
                            f"{n_query_cities} questions (needs up to {worst} tokens with {tokenizer.name})")

    def _enc(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text), np.int32)

    def _needle(self, city: str, number: int) -> np.ndarray:
        return self._enc(f" The magic number of {city} is {number}.")

    def _question(self, city: str) -> np.ndarray:
        return self._enc(f" What is the magic number of {city}? The magic number of {city} is")

    def _answer(self, number: int) -> np.ndarray:
        return self._enc(f" {number}")

    def example(self, rng: np.random.Generator, depth: float | None = None) -> Example:
        depth = float(rng.uniform()) if depth is None else float(depth)
        cities = [CITIES[i] for i in rng.choice(len(CITIES), self.n_needles, replace=False)]
        numbers = [int(n) for n in rng.choice(9_000_000, self.n_needles, replace=False) + 1_000_000]
        needles = [self._needle(c, n) for c, n in zip(cities, numbers, strict=True)]

        # The tail: R questions, each followed by its answer; only answer tokens are trained.
        tail, answers, pos = [], [], 0
        for r in range(self.n_query):
            question = np.concatenate([self._dot, self._question(cities[r])]) if r else self._question(cities[r])
            answer = self._answer(numbers[r])
            answers.append((pos + len(question), pos + len(question) + len(answer)))
            tail += [question, answer]
            pos += len(question) + len(answer)
        tail = np.concatenate(tail)
        budget = self.length - len(tail) - sum(len(n) for n in needles)

        # Filler sentences cut to exactly `budget` tokens; needles go in between sentences.
        units, total = [], 0
        while total < budget:
            units.append(self._filler[rng.integers(len(self._filler))][:budget - total])
            total += len(units[-1])
        # Distractors (and the other queried needles) first, at random sentence boundaries...
        for i in range(1, self.n_needles):
            units.insert(int(rng.integers(len(units) + 1)), needles[i])
        # ...then the answer needle at the boundary nearest the requested depth of the context.
        edges = np.cumsum([0] + [len(u) for u in units])
        k = int(np.argmin(np.abs(edges - depth * edges[-1])))
        at = int(edges[k])
        units.insert(k, needles[0])
        context_len = int(edges[-1])
        sequence = np.concatenate(units + [tail]).astype(np.int32)
        assert len(sequence) == self.length, (len(sequence), self.length)

        offset = context_len + len(needles[0])  # start of the tail in the sequence
        answers = [(offset + s, offset + e) for s, e in answers]
        loss_mask = np.zeros(self.length - 1, np.float32)
        for s, e in answers:
            loss_mask[s - 1:e - 1] = 1.0  # targets[t] = sequence[t + 1]
        info = {"answer_start": np.array([s - 1 for s, _ in answers], np.int32),  # in targets / logits coordinates
                "answer_end": np.array([e - 1 for _, e in answers], np.int32),
                "needle_start": np.int32(at),  # the depth-controlled needle, in tokens coordinates
                "needle_end": np.int32(at + len(needles[0])),
                "depth": np.float32(at / max(1, context_len)),  # needle_start / context_len (answer needle excluded)
                "context_len": np.int32(context_len + len(needles[0])),  # tokens before the first question
                "requested_depth": np.float32(depth),
                "numbers": np.array(numbers[:self.n_query], np.int64)}
        return Example(sequence, loss_mask, info)


def mqar_misfit(tokenizer, vocab: int) -> tuple[str, str] | None:
    """(field, why and the fix) where MQAR's three ranges of `vocab` ids do not fit between MQAR_OFFSET and the
    tokenizer's end-of-text id, else None."""
    room = (tokenizer.eos_id - MQAR_OFFSET) // 3
    if room < 1:
        return "data.tasks", (f"MQAR draws its ids between {MQAR_OFFSET} and the end-of-text id, and "
                              f"{tokenizer.name}'s is {tokenizer.eos_id}: leave mqar out (data.tasks=retrieval) or "
                              f"use a text source")
    if vocab > room:
        return "data.mqar_vocab", (f"three ranges of {vocab} ids do not fit in the {tokenizer.name} vocabulary (at "
                                   f"most {room})")
    return None


class MQARTask:
    def __init__(self, tokenizer, seq_len: int, n_pairs: int, n_queries: int, vocab: int):
        self.length, self.n_pairs, self.n_queries, self.vocab = seq_len + 1, n_pairs, n_queries, vocab
        if not 1 <= n_pairs <= vocab:
            raise DataError(f"mqar: need 1 <= mqar_pairs ({n_pairs}) <= mqar_vocab ({vocab})")
        misfit = mqar_misfit(tokenizer, vocab)
        if misfit:
            raise DataError(": ".join(misfit))
        if 2 * (n_pairs + n_queries) > self.length:
            raise DataError(f"mqar: seq_len {seq_len} is too short for {n_pairs} pairs and {n_queries} queries")

    def example(self, rng: np.random.Generator) -> Example:
        keys = MQAR_OFFSET + rng.choice(self.vocab, self.n_pairs, replace=False)
        values = MQAR_OFFSET + self.vocab + rng.choice(self.vocab, self.n_pairs, replace=False)
        sequence = (MQAR_OFFSET + 2 * self.vocab + rng.integers(self.vocab, size=self.length)).astype(np.int32)
        sequence[0:2 * self.n_pairs:2], sequence[1:2 * self.n_pairs:2] = keys, values
        # Queries are (key, value) pairs at random 2-token slots after the key-value section.
        n_slots = (self.length - 2 * self.n_pairs) // 2
        slots = 2 * self.n_pairs + 2 * np.sort(rng.choice(n_slots, self.n_queries, replace=False))
        asked = rng.choice(self.n_pairs, self.n_queries, replace=self.n_queries > self.n_pairs)
        sequence[slots], sequence[slots + 1] = keys[asked], values[asked]
        loss_mask = np.zeros(self.length - 1, np.float32)
        loss_mask[slots] = 1.0  # targets[slot] = sequence[slot + 1], the value of the queried key
        info = {"query_positions": slots.astype(np.int32), "keys": keys.astype(np.int32),
                "values": values.astype(np.int32)}
        return Example(sequence, loss_mask, info)


def make_tasks(data_cfg, tokenizer) -> dict:
    tasks = {}
    for name in data_cfg.tasks:
        if name == "retrieval":
            tasks[name] = RetrievalTask(tokenizer, data_cfg.seq_len, data_cfg.n_needles, data_cfg.n_query_cities)
        elif name == "mqar":
            tasks[name] = MQARTask(tokenizer, data_cfg.seq_len, data_cfg.mqar_pairs, data_cfg.mqar_queries,
                                   data_cfg.mqar_vocab)
        else:
            raise DataError(f"unknown synthetic task {name!r}; choose from {TASKS}")
    return tasks


def to_row(example: Example) -> dict[str, np.ndarray]:
    """One batch row: a single unpacked document filling the whole sequence."""
    seq, t = example.sequence, len(example.loss_mask)
    return {"tokens": seq[:-1], "targets": seq[1:], "loss_mask": example.loss_mask, "segment_ids": np.ones(t, np.int32),
            "positions": np.arange(t, dtype=np.int32)}


class SyntheticSource:
    """Grain random-access source of the task mixture: example `i` is task-sampled and built from (seed, i)."""

    def __init__(self, data_cfg, tokenizer, split: str = "train"):
        # training examples follow the batch-order seed; validation ones the split's, shared by a sweep's members
        self.seed = data_cfg.seed if split == "train" else data_cfg.split_seed
        self.salt = SALTS[split]
        self.tasks = make_tasks(data_cfg, tokenizer)
        names = list(self.tasks)
        weights = np.asarray(data_cfg.task_weights or [1.0] * len(names), np.float64)
        self.names, self.probs = names, weights / weights.sum()

    def __len__(self) -> int:
        return SOURCE_LEN

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = example_rng(self.seed, self.salt, int(index))
        name = self.names[rng.choice(len(self.names), p=self.probs)]
        return to_row(self.tasks[name].example(rng))

    def __repr__(self) -> str:
        return f"SyntheticSource(tasks={self.names}, seed={self.seed}, salt={self.salt})"


def _stack(examples: list[Example]) -> dict[str, np.ndarray]:
    rows = [to_row(e) | e.info for e in examples]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def retrieval_examples(data_cfg, n: int, *, depth: float, tokenizer=None, seed: int | None = None,
                       n_needles: int | None = None, n_query_cities: int | None = None,
                       seq_len: int | None = None) -> dict[str, np.ndarray]:
    """`n` retrieval examples with the answer needle at `depth`, as an evaluation batch: the training keys ([n, T])
    and `RetrievalTask.example`'s info, stacked. Example i has the same cities, numbers and filler at every depth."""
    tokenizer = tokenizer or get_tokenizer(data_cfg.tokenizer)
    task = RetrievalTask(tokenizer, seq_len or data_cfg.seq_len, n_needles or data_cfg.n_needles,
                         n_query_cities or data_cfg.n_query_cities)
    seed = data_cfg.seed if seed is None else seed
    return _stack([task.example(example_rng(seed, SALTS["eval"], i), depth=depth) for i in range(n)])


def mqar_examples(data_cfg, n: int, *, tokenizer=None, seed: int | None = None) -> dict[str, np.ndarray]:
    """`n` MQAR evaluation examples: the training batch keys plus query_positions [n, Q], keys / values [n, D]."""
    tokenizer = tokenizer or get_tokenizer(data_cfg.tokenizer)
    task = MQARTask(tokenizer, data_cfg.seq_len, data_cfg.mqar_pairs, data_cfg.mqar_queries, data_cfg.mqar_vocab)
    seed = data_cfg.seed if seed is None else seed
    return _stack([task.example(example_rng(seed, SALTS["eval"], i, 1)) for i in range(n)])

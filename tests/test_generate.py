"""`diffjax generate` and its decoding (diffjax/model/generate.py): greedy continuations equal transformers'
generate() on the HF fixtures (Llama, DiffLlama, Qwen2, Qwen3, Mistral; golden ids made by
tests/fixtures/generate/make_fixtures.py; live as well where transformers is installed); a left-padded batch
decodes as each prompt alone; the top-k / top-p masks are transformers' warpers (against an independent NumPy
version, and the warpers themselves live); sampling draws from the warped distribution and is seeded; one decode
step compiles for every prompt length; the command prints text, and refuses bad input with one line and exit 2,
the run directory untouched."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import trained_diff
from test_hf_cli import CFG

from diffjax.cli import main
from diffjax.config import ConfigError, ModelConfig
from diffjax.data.tokenizer import ByteTokenizer
from diffjax.generate import Stream
from diffjax.hf import load_pretrained
from diffjax.hf.run import import_run
from diffjax.model import DecoderLM, decode_step, init_cache
from diffjax.model import generate as gen
from diffjax.model.attention import KVCache
from diffjax.train.run_loader import load_run

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "generate" / "greedy.json").read_text())
LIVE = pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                          reason="live comparison needs torch and transformers")


CONTEXT = 64  # the fixtures' 96 ids fit no diffjax tokenizer, so they load as HF directories, not as runs
MODELS = ("llama", "diffllama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def hf_models():
    """name -> (model config, params) of the HF fixture models."""
    return {name: load_pretrained(FIXTURES / "hf" / name) for name in MODELS}


def until_eos(ids: list[int], eos: int) -> list[int]:
    """transformers' new ids up to the first EOS (after it, a finished row is padding)."""
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_transformers_golden(hf_models, name):
    """Prompts of 1-33 tokens (two buckets), in one batch and in batches of two (the last one short)."""
    cfg, params = hf_models[name]
    golden = next(m for m in GOLDEN["models"] if m["model"].endswith("/" + name))
    expected = [until_eos(ids, GOLDEN["eos_token_id"]) for ids in golden["generated"]]
    llama = name in ("llama", "diffllama")
    if llama:  # the others never produce the EOS id
        assert any(len(e) < GOLDEN["max_new_tokens"] for e in expected)  # some rows stop at EOS
    for batch_size in (len(GOLDEN["prompts"]), 2) if llama else (len(GOLDEN["prompts"]),):  # batching: arch-blind
        got = gen.generate(cfg, params, GOLDEN["prompts"], max_new_tokens=GOLDEN["max_new_tokens"],
                           max_len=CONTEXT, eos_id=GOLDEN["eos_token_id"], batch_size=batch_size)
        assert got == expected, batch_size


@LIVE
@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_transformers_live(hf_models, name, rng):
    """Fresh prompts of random lengths, through the fixture script's own transformers call."""
    spec = importlib.util.spec_from_file_location("make_generate", FIXTURES / "generate" / "make_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from transformers import AutoModelForCausalLM

    cfg, params = hf_models[name]
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in rng.integers(1, 40, 4)]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "hf" / name).eval()
    expected = [until_eos(ids, script.EOS) for ids in script.hf_greedy(model, prompts)]
    got = gen.generate(cfg, params, prompts, max_new_tokens=script.MAX_NEW_TOKENS, max_len=CONTEXT,
                       eos_id=script.EOS)
    for prompt, new, want in zip(prompts, got, expected, strict=True):
        margins = greedy_with_margins(cfg, params, prompt, script.MAX_NEW_TOKENS, script.EOS, width=CONTEXT)[1]
        sure = before_a_near_tie(margins)  # torch's and XLA's rounding may break a near-tie either way
        assert new[:sure] == want[:sure], (new, want, margins)


def greedy_by_forward(cfg, params, prompt: list[int], n: int, eos: int | None, width: int = 64) -> list[int]:
    """Greedy decoding by full forward passes (no cache), each over the ids right-padded to `width` (exact:
    causal attention) so that one program serves every length."""
    return greedy_with_margins(cfg, params, prompt, n, eos, width)[0]


def greedy_with_margins(cfg, params, prompt: list[int], n: int, eos: int | None, width: int = 64):
    """`greedy_by_forward`'s ids and, for each step it took, the gap between the top two logits."""
    forward, ids, margins = jax.jit(DecoderLM(cfg).apply), [], []
    for _ in range(n):
        seq = prompt + ids
        logits = np.asarray(forward({"params": params}, jnp.asarray([seq + [0] * (width - len(seq))])))[0, len(seq) - 1]
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        nxt = int(np.argmax(logits))
        if nxt == eos:
            break
        ids.append(nxt)
    return ids, margins


def before_a_near_tie(margins: list[float]) -> int | None:
    """How many greedy ids are sure: those before the first step whose top two logits are within 1e-4 (None: all)."""
    return next((i for i, m in enumerate(margins) if m < 1e-4), None)


def random_model(arch: str, rng, **kw):
    cfg = ModelConfig(**{"arch": arch, "vocab_size": 300, "d_model": 64, "n_layers": 2, "head_dim": 16,
                         "n_heads": 4 if arch == "transformer" else 2, "dtype": "float32", **kw})
    tokens = jnp.zeros((1, 8), jnp.int32)
    return cfg, jax.jit(DecoderLM(cfg).init)(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]


def test_cache_positions_and_mask_of_left_padded_rows(rng):
    """KVCache with random row starts and fill: a row's positions count from its start; a real query sees the keys
    from its row's start to itself, a padding query the padding up to itself (so no mask row is empty)."""
    cfg, b, s, t = ModelConfig(dtype="float32"), 4, 16, 5
    kv = KVCache(cfg)
    k = jnp.asarray(rng.normal(size=(b, t, 1, 8)), jnp.float32)
    cache = kv.init(jax.random.key(0), jnp.zeros((b, s, 1, 8)), jnp.zeros((b, s, 1, 8)))["cache"]
    start, index = rng.integers(0, 12, b), int(rng.integers(0, s - t + 1))
    cache = {**cache, "start": jnp.asarray(start, jnp.int32), "index": jnp.asarray(index, jnp.int32)}
    (_, _, mask, positions, slots), _ = kv.apply({"cache": cache}, k, k, mutable=["cache"])
    slot = index + np.arange(t)[None, :, None]  # [1, T, 1]
    key, first = np.arange(s)[None, None, :], start[:, None, None]
    np.testing.assert_array_equal(slots, np.broadcast_to(slot[..., 0], (b, t)))
    np.testing.assert_array_equal(positions, slot[..., 0] - start[:, None])
    np.testing.assert_array_equal(mask[:, 0], (key <= slot) & ((key >= first) == (slot >= first)))


@pytest.mark.parametrize("arch,scan", [("diff", False), ("transformer", True), ("dint", False)])
def test_left_padded_rows_decode_as_alone(arch, scan, rng):
    """Rows left-padded to one length with their starts in the cache: every real token's logits, in the prefill
    and in the steps after it, equal the full forward pass of that row alone (its positions from 0)."""
    cfg, params = random_model(arch, rng, scan_layers=scan)
    lengths, width, steps = [3, 9, 6], 9, 3
    rows = [rng.integers(0, 300, n + steps) for n in lengths]
    prompt = np.stack([np.pad(r[:n], (width - n, 0), constant_values=7) for r, n in zip(rows, lengths, strict=True)])
    step = jax.jit(lambda c, t: decode_step(cfg, params, c, t))
    out, cache = step(init_cache(cfg, 3, 16, start=[width - n for n in lengths]), jnp.asarray(prompt))
    outs = [out]
    for s in range(steps):
        out, cache = step(cache, jnp.asarray(np.stack([r[n + s] for r, n in zip(rows, lengths, strict=True)]))[:, None])
        outs.append(out)
    decoded = np.concatenate(outs, axis=1)
    longest = max(lengths) + steps  # each row alone, right-padded to one length (exact: causal attention)
    alone = np.asarray(jax.jit(DecoderLM(cfg).apply)({"params": params}, jnp.asarray(
        np.stack([np.pad(r, (0, longest - len(r))) for r in rows]))))
    for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        np.testing.assert_allclose(decoded[i, width - n:], alone[i, :len(r)], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_a_padded_batch_generates_as_each_prompt_alone(arch, rng):
    """Greedy: prompts of random lengths in one batch give the ids each gives in a batch of its own, and those are
    greedy decoding by full forward passes (no cache)."""
    cfg, params = random_model(arch, rng)
    prompts = [rng.integers(0, 300, n).tolist() for n in rng.integers(1, 40, 4)]
    kw = dict(max_new_tokens=6, max_len=64, eos_id=int(rng.integers(0, 300)))
    batched = gen.generate(cfg, params, prompts, batch_size=len(prompts), **kw)
    alone = [gen.generate(cfg, params, [p], batch_size=1, **kw)[0] for p in prompts]
    for prompt, new, one in zip(prompts, batched, alone, strict=True):
        want, margins = greedy_with_margins(cfg, params, prompt, kw["max_new_tokens"], kw["eos_id"])
        sure = before_a_near_tie(margins)  # the three paths' float32 rounding (~1e-7) may flip a near-tie's argmax
        assert new[:sure] == one[:sure] == want[:sure], (new, one, want, margins)


def test_one_decode_step_compiles_for_every_prompt_length(rng):
    """Prompts of three buckets, one at a time: three prefills and one decode step compile."""
    cfg, params = random_model("diff", rng, vocab_size=301)  # a config no other test compiles
    before = gen._advance._cache_size()
    gen.generate(cfg, params, [[1] * 3, [2] * 40, [3] * 70], max_new_tokens=4, max_len=128, eos_id=None, batch_size=1)
    assert gen._advance._cache_size() - before == 3 + 1


def numpy_top_k(logits, k):
    """The tokens at least as large as the k-th largest."""
    return logits >= np.sort(logits, axis=-1)[:, -k][:, None]


def numpy_top_p(logits, p):
    """Most probable first, a token is kept while the probability of the tokens before it is below p; and the
    least margin between those sums and p (where float rounding could decide)."""
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    ranked = np.take_along_axis(probs, order, -1)
    before = np.cumsum(ranked, -1) - ranked
    keep = np.zeros(z.shape, bool)
    np.put_along_axis(keep, order, before < p[:, None], -1)
    return keep, np.abs(before - p[:, None]).min()


def test_top_k_and_top_p_masks_are_transformers_warpers(rng):
    logits = np.round(rng.normal(0, 2, (64, 50)), 1).astype(np.float32)  # rounded: ties at the k-th value
    for k in (1, 5, 17, 50):
        np.testing.assert_array_equal(gen.top_k_mask(jnp.asarray(logits), k), numpy_top_k(logits, k))
    np.testing.assert_array_equal(gen.top_k_mask(jnp.asarray(logits), 0), np.ones(logits.shape, bool))
    logits = rng.normal(0, 3, (64, 50)).astype(np.float32)
    while True:  # fresh p per row, away from a boundary where float32 and float64 sums could disagree
        p = rng.uniform(0.01, 1.0, 64)
        expected, margin = numpy_top_p(logits, p)
        if margin > 1e-4:
            break
    got = np.asarray(jax.vmap(gen.top_p_mask)(jnp.asarray(logits), jnp.asarray(p, jnp.float32)))
    np.testing.assert_array_equal(got, expected)
    assert (got.sum(-1) > 1).any() and (got.sum(-1) < 50).all()  # the sets are neither trivial nor everything
    assert np.asarray(gen.top_p_mask(jnp.asarray(logits), 1e-6)).sum(-1).tolist() == [1] * 64  # one at least


@LIVE
def test_masks_equal_transformers_warpers_live(rng):
    import torch
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = rng.normal(0, 3, (32, 50)).astype(np.float32)
    for k in (1, 7, 49):
        warped = TopKLogitsWarper(k)(None, torch.from_numpy(logits)).numpy()
        np.testing.assert_array_equal(gen.top_k_mask(jnp.asarray(logits), k), warped > -np.inf)
    for p in rng.uniform(0.05, 1.0, 5):
        warped = TopPLogitsWarper(float(p))(None, torch.from_numpy(logits)).numpy()
        np.testing.assert_array_equal(gen.top_p_mask(jnp.asarray(logits), float(p)), warped > -np.inf)


def test_sampling_draws_from_the_warped_distribution(rng):
    """20,000 draws from one row of logits: the frequencies are softmax(logits / T) over the tokens top-k then
    top-p keep (NumPy), renormalised; temperature 0 is the argmax whatever the other settings."""
    n, sampling = 20_000, gen.Sampling(temperature=0.7, top_k=6, top_p=0.8)
    while True:  # logits where top-p drops some of the tokens top-k keeps, but not all but one
        logits = rng.normal(0, 1.5, 8).astype(np.float32)
        scaled = logits / sampling.temperature
        keep = numpy_top_k(scaled[None], sampling.top_k)[0]
        keep &= numpy_top_p(np.where(keep, scaled, -np.inf)[None], np.array([sampling.top_p]))[0][0]
        if 1 < keep.sum() < sampling.top_k:
            break
    expected = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    expected /= expected.sum()
    draws = jax.jit(gen.sample, static_argnames="sampling")(
        jnp.tile(jnp.asarray(logits), (n, 1)), jax.random.split(jax.random.key(int(rng.integers(1 << 30))), n),
        sampling=sampling)
    np.testing.assert_allclose(np.bincount(np.asarray(draws), minlength=8) / n, expected, atol=0.015)
    greedy = gen.sample(jnp.asarray(logits[None]), jax.random.split(jax.random.key(0), 1), gen.Sampling(0, 3, 0.5))
    assert int(greedy[0]) == int(np.argmax(logits))


def test_the_same_seed_gives_the_same_samples(rng):
    cfg, params = random_model("diff", rng)
    prompts = [rng.integers(0, 300, n).tolist() for n in (5, 11)]
    kw = dict(max_new_tokens=12, max_len=64, eos_id=None, sampling=gen.Sampling(1.0, top_k=50, top_p=0.95))
    first = gen.generate(cfg, params, prompts, seed=3, **kw)
    assert gen.generate(cfg, params, prompts, seed=3, **kw) == first
    assert gen.generate(cfg, params, prompts, seed=4, **kw) != first


def test_bad_settings_are_refused():
    for settings, words in [({"temperature": -1.0}, "temperature"), ({"top_k": -1}, "top_k"),
                            ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")]:
        with pytest.raises(ConfigError, match=words):
            gen.Sampling(**settings)
    with pytest.raises(ConfigError, match="context of 16"):
        gen.check_prompts([[1] * 4, [1] * 10], max_new_tokens=7, max_len=16, vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary"):
        gen.check_prompts([[1, 300]], max_new_tokens=1, max_len=16, vocab_size=300)


def test_streaming_never_splits_a_character():
    """Byte ids arriving one at a time: what is written never holds a replacement character, and adds up to the
    text."""
    text, tok = "a é € 😀 z", ByteTokenizer()
    ids, writes = tok.encode(text), []

    class Out:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    stream = Stream(tok, Out())
    for n in range(1, len(ids) + 1):
        stream.on_token(0, ids[:n])
    stream.on_done(0, ids)
    assert "".join(writes) == text + "\n" and not any("\ufffd" in w for w in writes)


# the command ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A run directory of a tiny DIFF model on the byte tokenizer (context: data.seq_len = 256)."""
    workdir = tmp_path_factory.mktemp("generate_cli") / "run"
    import_run(None, workdir, [], model_cfg=CFG, params=trained_diff(CFG))
    return workdir


def listing(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def test_bad_input_is_one_line_and_exit_2_and_the_run_is_untouched(byte_run, tmp_path, capsys):
    before = listing(byte_run)
    run = ["generate", "--workdir", str(byte_run)]
    cases = [(["--prompt", "hi", "--top-p", "0"], "top_p"), (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
             (["--prompt", "hi", "--top-k", "-1"], "top_k"), (["--prompt", "hi", "--temperature", "-1"], "temperature"),
             (["--prompt", "x" * 252, "--max-new-tokens", "5"], "context of 256"),
             (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
             (["--prompts", str(tmp_path / "missing.txt")], "no such file")]
    for args, words in cases:
        assert main(run + args) == 2, args
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, (args, err)
    assert listing(byte_run) == before


@pytest.mark.slow  # the command end to end
def test_generate_prints_the_greedy_text(byte_run, tmp_path, capsys):
    """One prompt streams prompt + continuation; several print in their order under headers; each continuation is
    greedy decoding by full forward passes; the run directory is unchanged."""
    before = listing(byte_run)
    cfg, params, _ = load_run(byte_run, params_only=True)
    tok = ByteTokenizer()

    def greedy(text, n):
        return tok.decode(greedy_by_forward(cfg.model, params, tok.encode(text), n, tok.eos_id))

    assert main(["generate", "--workdir", str(byte_run), "--prompt", "The cat", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == "The cat" + greedy("The cat", 10) + "\n"
    prompts = ["Once upon a time", "a", "Hello, world"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    assert main(["generate", "--workdir", str(byte_run), "--prompts", str(tmp_path / "prompts.txt"),
                 "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    expected = "".join(f"=== prompt {i + 1}/3 ===\n{p}{greedy(p, 8)}\n" for i, p in enumerate(prompts))
    assert capsys.readouterr().out == expected
    assert main(["generate", "--workdir", str(byte_run), "--prompt", "The cat", "--max-new-tokens", "10",
                 "--temperature", "1.0", "--top-p", "0.9", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("The cat")
    assert listing(byte_run) == before

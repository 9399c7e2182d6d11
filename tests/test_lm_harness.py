"""`diffjax lm-eval`: lm-evaluation-harness drives a diffjax run on offline local tasks (tests/fixtures/lm_eval);
the loglikelihoods lm-eval receives equal diffjax's own scoring of the same continuations, unbatched and
unpadded, and greedy generation with the KV cache equals greedy decoding by full forward passes."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

pytest.importorskip("lm_eval")
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402
from test_hf import trained_diff  # noqa: E402
from test_hf_cli import CFG  # noqa: E402

from diffjax.cli import main  # noqa: E402
from diffjax.data.tokenizer import ByteTokenizer  # noqa: E402
from diffjax.hf.run import import_run  # noqa: E402
from diffjax.model import DecoderLM  # noqa: E402

DATA = Path(__file__).parent / "fixtures" / "lm_eval" / "tiny.jsonl"
COMMON = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA)}}, "test_split": "test"}
TASKS = {
    "diffjax_tiny_choice": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                            "metric_list": [{"metric": "acc"}]},
    "diffjax_tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                             "metric_list": [{"metric": "word_perplexity"}]},
    "diffjax_tiny_generate": {"output_type": "generate_until", "doc_to_text": "{{text}}",
                              "doc_to_target": "{{choices[0]}}", "metric_list": [{"metric": "exact_match"}],
                              "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6}},
}
MAX_LENGTH = 48  # short enough that the rolling documents need two windows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    for name, task in TASKS.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **COMMON, **task}))
    params = trained_diff(CFG)
    import_run(None, root / "run", [], model_cfg=CFG, params=params)
    return root, params


forward = jax.jit(lambda params, tokens: DecoderLM(CFG).apply({"params": params}, tokens))  # one call per shape


def own_logprob(params, context: list[int], continuation: list[int]) -> float:
    """Σ log p(continuation | context) from one unpadded forward pass."""
    whole = jnp.asarray([context + continuation])
    logp = np.asarray(jax.nn.log_softmax(forward(params, whole[:, :-1]), -1))[0]
    return float(sum(logp[len(context) - 1 + j, t] for j, t in enumerate(continuation)))


@pytest.mark.slow  # end to end through the CLI
def test_lm_eval_receives_diffjax_loglikelihoods_and_generations(setup, monkeypatch, capsys):
    root, params = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = root / "results.json"
    assert main(["lm-eval", "--workdir", str(root / "run"), "--tasks", ",".join(TASKS), "--include", str(root),
                 "--max-length", str(MAX_LENGTH), "--batch-size", "2", "--out", str(out), "--log-samples"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in TASKS) and "acc" in table
    results = json.loads(out.read_text())
    tok = ByteTokenizer()
    choice = results["samples"]["diffjax_tiny_choice"]
    assert len(choice) == 3
    for sample in choice:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = tok.encode(context) or [tok.eos_id]
            assert abs(float(resp[0][0]) - own_logprob(params, ctx, tok.encode(continuation))) <= 1e-4
    for sample in results["samples"]["diffjax_tiny_rolling"]:  # lm-eval's windows, scored by diffjax alone
        windows = get_rolling_token_windows(token_list=tok.encode(sample["doc"]["text"]), prefix_token=tok.eos_id,
                                            max_seq_len=MAX_LENGTH, context_len=1)
        expected = sum(own_logprob(params, list(c), list(t)) for c, t in map(make_disjoint_window, windows))
        assert abs(float(sample["resps"][0][0]) - expected) <= 1e-3
    for sample in results["samples"]["diffjax_tiny_generate"]:
        ids = tok.encode(sample["arguments"][0][0])[-(MAX_LENGTH - 6):]  # room for the 6 new tokens
        generated = []
        for _ in range(6):  # greedy by full forward passes, no cache
            logits = forward(params, jnp.asarray([ids + generated]))
            nxt = int(np.argmax(np.asarray(logits)[0, -1]))
            generated.append(nxt)
            if nxt == tok.eos_id or "\n" in tok.decode(generated):
                break
        text = tok.decode(t for t in generated if t != tok.eos_id).split("\n")[0]
        assert sample["resps"][0][0] == text


@pytest.mark.slow  # end to end through the CLI
def test_unknown_task_exits_2(setup, capsys, monkeypatch):
    """(lm-eval's index of its ~10k built-in tasks, which a name not found locally falls back to, takes ~25 s to build:
    here it holds the local tasks alone, so the name is unknown to it just as it would be to the full one.)"""
    import lm_eval.tasks

    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: real(**kw | {"include_defaults": False}))
    root, _ = setup
    assert main(["lm-eval", "--workdir", str(root / "run"), "--tasks", "no_such_task", "--include",
                 str(root)]) == 2
    assert "no_such_task" in capsys.readouterr().err


PEER = Path(__file__).parent / "fixtures" / "lm_eval" / "hf_peer"


@pytest.mark.slow  # end to end through the CLI
def test_lm_eval_scores_as_its_own_hf_backend_on_a_model_with_its_own_tokenizer(setup, tmp_path, monkeypatch,
                                                                                 capsys):
    """A Llama with its own BPE tokenizer, imported (the tokenizer comes with it): `diffjax lm-eval` gives, request by
    request, the log-likelihoods lm-eval's own `--model hf` backend gives the checkpoint (golden ids from
    tests/fixtures/lm_eval/make_hf_peer.py) — its BOS starting each rolling window, as the backend's does."""
    root, _ = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, out = tmp_path / "run", tmp_path / "results.json"
    assert main(["hf", "import", str(PEER), "--workdir", str(run), "--set", "data.tasks=retrieval",
                 "--set", "data.seq_len=512"]) == 0
    golden = json.loads((PEER / "golden.json").read_text())
    assert main(["lm-eval", "--workdir", str(run), "--tasks", ",".join(golden), "--include", str(root),
                 "--max-length", str(MAX_LENGTH), "--batch-size", "2", "--out", str(out), "--log-samples"]) == 0
    capsys.readouterr()
    samples = json.loads(out.read_text())["samples"]
    for task, expected in golden.items():
        got = [[float(r[0][0] if isinstance(r[0], list) else r[0]) for r in sample["resps"]]
               for sample in sorted(samples[task], key=lambda s: s["doc_id"])]
        assert [len(g) for g in got] == [len(e) for e in expected], task
        for g, e in zip(got, expected, strict=True):  # docs of a task have different numbers of choices
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-3, err_msg=task)

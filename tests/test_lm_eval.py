"""lm-eval (EleutherAI's harness) through the real server scores as lm-eval's own `hf` backend
does on the same SmolLM2 weights: a multiple-choice task through `local-completions` (each choice
one echoed prompt, its loglikelihood read from the prompt logprobs), and a generative task through
`local-completions` and, under the chat template, through `local-chat-completions` (whose messages
the server renders into the tokens hf's rendering gives). The tasks are tests/data/lm_eval/*.yaml.
Both sides run fp32: per-choice loglikelihoods agree to 1e-3, and each greedy answer is the same text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import needs_smollm2
from test_server_openai import MODEL, Server, assert_clean_exit

from nanolab.model.tokenizer import Tokenizer

pytest.importorskip("lm_eval", reason="lm-eval is installed from requirements.txt")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "data" / "lm_eval"
MC, GEN = "nanolab_facts_mc", "nanolab_facts_gen"
LOGLIKELIHOOD_ATOL = 1e-3


def evaluate(lm, tasks: list[str], **kw) -> dict:
    """simple_evaluate over our tasks alone (lm-eval's thousands of built-in ones are not indexed).
    Zero-shot and greedy, so no seed matters: the session's global RNGs are left as they are."""
    return simple_evaluate(lm, tasks=tasks, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                           log_samples=True, bootstrap_iters=0, random_seed=None, numpy_random_seed=None,
                           torch_random_seed=None, **kw)


def by_doc(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def assert_same_loglikelihoods(got: dict, want: dict) -> None:
    """The multiple-choice task: each choice's (loglikelihood, is_greedy) per question, then the accuracy."""
    for g, w in zip(by_doc(got, MC), by_doc(want, MC), strict=True):
        assert len(g["resps"]) == len(w["resps"]) == 4
        for choice, (((g_ll, g_greedy),), ((w_ll, w_greedy),)) in enumerate(zip(g["resps"], w["resps"])):
            where = f"doc {g['doc_id']} choice {choice}"
            assert abs(g_ll - w_ll) < LOGLIKELIHOOD_ATOL, f"{where}: loglikelihood {g_ll} against hf's {w_ll}"
            assert g_greedy == w_greedy, f"{where}: is_greedy {g_greedy} against hf's {w_greedy}"
    assert got["results"][MC]["acc,none"] == want["results"][MC]["acc,none"]


def assert_same_answers(got: dict, want: dict, what: str) -> None:
    """The generative task: every greedy answer is hf's text, and so is the score."""
    for g, w in zip(by_doc(got, GEN), by_doc(want, GEN), strict=True):
        assert g["resps"] == w["resps"], f"{what}, doc {g['doc_id']}: {g['resps']} against hf's {w['resps']}"
        assert g["filtered_resps"] == w["filtered_resps"]
    assert got["results"][GEN] == want["results"][GEN], what


def assert_same_chat_prompts(hf, tokenizer: Tokenizer, got: dict, want: dict) -> None:
    """The messages local-chat-completions sent, as the server tokenizes them, are the tokens of
    the prompt hf rendered with the model's chat template (default system turn included)."""
    for g, w in zip(by_doc(got, GEN), by_doc(want, GEN), strict=True):
        ((messages,), _), = g["arguments"]  # the messages as JSON
        (rendered, _), = w["arguments"]
        assert tokenizer.encode_chat(json.loads(messages)) == hf.tok_encode(rendered), f"doc {g['doc_id']}"


@needs_smollm2
@pytest.mark.slow
def test_lm_eval_scores_through_the_server_equal_hf(smollm2_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the task YAMLs name their data relative to the repo root
    hf = HFLM(pretrained=str(smollm2_path), dtype="float32", device="cpu", batch_size=16)
    want = evaluate(hf, [MC, GEN])
    want_chat = evaluate(hf, [GEN], apply_chat_template=True)

    server = Server("--read", "reference", "--dtype", "float32")
    try:
        completions = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL,
                                          tokenizer=str(smollm2_path), tokenizer_backend="huggingface",
                                          tokenized_requests=True, batch_size=16)
        got = evaluate(completions, [MC, GEN])
        chat = LocalChatCompletion(base_url=server.url + "/v1/chat/completions", model=MODEL, num_concurrent=10)
        got_chat = evaluate(chat, [GEN], apply_chat_template=True)
    finally:
        assert_clean_exit(server)

    assert_same_loglikelihoods(got, want)
    assert_same_answers(got, want, "local-completions")
    assert_same_chat_prompts(hf, Tokenizer.from_dir(smollm2_path), got_chat, want_chat)
    assert_same_answers(got_chat, want_chat, "local-chat-completions")

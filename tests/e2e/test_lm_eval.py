"""lm-evaluation-harness against a live SmolLM2 server (fp32), on tiny tasks whose data lies in
tests/data/lm_eval, so nothing comes from the hub:

- `local-completions` scores the multiple-choice task kvserve_mc through the server's prompt logprobs
  (echo + logprobs); every request's log-likelihood equals lm-eval's own HF backend on the same weights
  within 1e-3, with the same is_greedy flag.
- `local-chat-completions` runs the generate_until task kvserve_gen; its answers are the server's greedy
  chat answers to the very messages lm-eval sent.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.models.loader import resolve_model_path
from tests.e2e.conftest import ROOT, SMOLLM2, Server

TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
LOGLIKELIHOOD_TOL = 1e-3  # the bound: kvserve's log-likelihoods vs lm-eval's HF backend
# 4 prompts per request (choices mapped back by index) and 2 requests in flight: the server scores
# prompts of one request and of concurrent ones in the same batched steps.
COMPLETIONS_BATCH_SIZE = 4
NUM_CONCURRENT = 2


@pytest.fixture(scope="module")
def task_manager() -> Iterator[Any]:
    """lm-eval's tasks from tests/data/lm_eval only (indexing its ~10k built-in tasks takes 6 s), used
    offline and from the repository root (the task files' data paths are relative to it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.chdir(ROOT)
        from lm_eval.tasks import TaskManager  # the test extra installs lm-eval; missing, this fails

        yield TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def _evaluate(task_manager: Any, task: str, model: str, model_args: dict[str, Any], **kwargs: Any) -> dict:
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=task_manager,
        log_samples=True,
        **kwargs,
    )
    assert results is not None
    return results


def _loglikelihoods(results: dict, task: str) -> dict[tuple[int, str], tuple[float, bool]]:
    """(doc id, continuation) -> (log-likelihood, is_greedy), one entry per loglikelihood request."""
    out = {}
    for sample in results["samples"][task]:
        for (_context, continuation), (resp,) in zip(sample["arguments"], sample["resps"], strict=True):
            out[(sample["doc_id"], continuation)] = (float(resp[0]), bool(resp[1]))
    return out


def _num_requests(data_file: Path, limit: int | None) -> int:
    docs = [json.loads(line) for line in data_file.read_text().splitlines()][:limit]
    return sum(len(doc["choices"]) for doc in docs)


@pytest.mark.parametrize(
    "limit",
    [pytest.param(4, id="4-docs"), pytest.param(None, id="all-docs", marks=pytest.mark.slow)],
)
def test_local_completions_loglikelihoods_equal_hf_backend(
    task_manager: Any, smollm2_server: Server, limit: int | None
) -> None:
    """`limit`: the task's first documents only (4 of them make 16 requests; all 10 make 37)."""
    model_dir = str(resolve_model_path(SMOLLM2))
    reference = _evaluate(
        task_manager,
        "kvserve_mc",
        "hf",
        {"pretrained": model_dir, "dtype": "float32", "device": "cpu"},
        batch_size=1,
        limit=limit,
    )
    model_args = {
        "base_url": smollm2_server.base_url + "/v1/completions",
        "model": SMOLLM2,
        "tokenizer": model_dir,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # prompts as token ids: lm-eval's context lengths index the server's tokens
        "batch_size": COMPLETIONS_BATCH_SIZE,
        "num_concurrent": NUM_CONCURRENT,
        "max_retries": 1,  # a rejected request fails the test at once instead of being retried
    }
    served = _evaluate(task_manager, "kvserve_mc", "local-completions", model_args, limit=limit)

    expected = _loglikelihoods(reference, "kvserve_mc")
    got = _loglikelihoods(served, "kvserve_mc")
    assert len(expected) == _num_requests(TASKS_DIR / "kvserve_mc.jsonl", limit)
    assert got.keys() == expected.keys()
    worst = max(abs(got[key][0] - loglikelihood) for key, (loglikelihood, _) in expected.items())
    print(f"\n{len(expected)} log-likelihoods, largest difference from lm-eval's HF backend {worst:.2e}")
    for key, (loglikelihood, is_greedy) in expected.items():
        assert got[key][0] == pytest.approx(loglikelihood, abs=LOGLIKELIHOOD_TOL), key
        assert got[key][1] == is_greedy, key
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["kvserve_mc"][metric] == reference["results"]["kvserve_mc"][metric]


def test_local_chat_completions_generate_until(task_manager: Any, smollm2_server: Server) -> None:
    model_args = {
        "base_url": smollm2_server.base_url + "/v1/chat/completions",
        "model": SMOLLM2,
        "max_retries": 1,
    }
    results = _evaluate(
        task_manager, "kvserve_gen", "local-chat-completions", model_args, apply_chat_template=True
    )
    samples = results["samples"]["kvserve_gen"]
    assert len(samples) == len((TASKS_DIR / "kvserve_gen.jsonl").read_text().splitlines())
    client = smollm2_server.client()
    for sample in samples:
        (((chat_json,), gen_kwargs),) = sample["arguments"]  # lm-eval's JsonChatStr, logged as a 1-tuple
        messages = json.loads(chat_json)  # the messages lm-eval sent
        assert messages[-1] == {"role": "user", "content": sample["doc"]["question"] + " Answer in one word."}
        direct = client.chat.completions.create(
            model=SMOLLM2,
            messages=messages,
            max_tokens=gen_kwargs["max_gen_toks"],
            stop=gen_kwargs["until"],
            temperature=0,
        )
        (answer,) = sample["resps"][0]
        assert answer == direct.choices[0].message.content
        assert answer.strip() and "\n" not in answer and "." not in answer  # stopped at `until`
    matches = [_normalized(s["filtered_resps"][0]) == _normalized(s["target"]) for s in samples]
    assert results["results"]["kvserve_gen"]["exact_match,none"] == sum(matches) / len(matches)


def _normalized(answer: str) -> str:
    """What the task's exact_match compares (ignore_case, ignore_punctuation)."""
    return answer.lower().translate(str.maketrans("", "", string.punctuation))

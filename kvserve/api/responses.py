"""OpenAI response bodies (whole and streamed chunks) built from RequestOutputs."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.api import tools
from kvserve.engine.async_engine import SHUTTING_DOWN
from kvserve.errors import KVServeError, OverloadedError, RequestTimeoutError
from kvserve.request import FinishReason, RequestOutput, TokenLogprob
from kvserve.tokenizer import Tokenizer


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int
    echo_text: str = ""  # the prompt's text when echo=true (completions)
    prompt_logprobs_sent: bool = False  # streamed completions: the prompt's logprobs go in the first chunk
    tool_stream: tools.ToolCallStream | None = None  # a streamed chat choice's tool-call parser


@dataclass
class Job:
    """One API call: its choices (prompt x n engine requests) and what its bodies need."""

    kind: Literal["completion", "chat"]
    model: str
    prompts: list[list[int]]
    choices: list[Choice]
    logprobs: bool
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calling: tools.ToolCalling | None = None  # chat: output parsed into tool_calls

    def choice_of(self, request_id: str) -> Choice:
        return next(c for c in self.choices if c.request_id == request_id)

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def head(self, object_name: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name or self.object,
            "created": self.created,
            "model": self.model,
        }


def raise_for_failure(out: RequestOutput) -> None:
    """A finished output that is not stop/length becomes the matching KVServeError."""
    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return
    if out.error == "timeout":
        raise RequestTimeoutError(
            "the request took longer than the server's request_timeout_s", code="timeout"
        )
    if out.error == SHUTTING_DOWN:
        raise OverloadedError(
            "the server is shutting down and stopped this request; retry it", code="shutting_down"
        )
    raise KVServeError(f"the request did not complete: {out.error or 'aborted'}")


def usage(job: Job, finals: dict[str, RequestOutput]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (n samples share it); cached tokens from its first sample."""
    first_of_prompt: dict[int, RequestOutput] = {}
    for c in job.choices:
        if c.request_id in finals:
            first_of_prompt.setdefault(c.prompt_index, finals[c.request_id])
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(o.token_ids) for o in finals.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(o.num_cached_tokens for o in first_of_prompt.values())
        },
        # kvserve extension: how the cached tokens were reused
        "kvserve": {
            "exact_cached_tokens": sum(o.num_exact_cached_tokens for o in first_of_prompt.values()),
            "approx_cached_tokens": sum(o.num_approx_cached_tokens for o in first_of_prompt.values()),
            "recomputed_tokens": sum(o.num_recomputed_tokens for o in first_of_prompt.values()),
            # prompts with content matches, by the cost-aware decision: "taken" or "declined: <why>"
            "reuse_plans": dict(Counter(o.reuse_plan for o in first_of_prompt.values() if o.reuse_plan)),
            # prompts served with a repair, by where it came from (auto names its verified preset)
            **(
                {
                    "reuse_presets": dict(
                        Counter(o.reuse_preset for o in first_of_prompt.values() if o.reuse_preset)
                    )
                }
                if any(o.reuse_preset for o in first_of_prompt.values())
                else {}
            ),
            # choices that asked for an audit (audit: true), by what became of it: "queued" or
            # "skipped: <why>" (past the server's budget, nothing approximate to audit, too many pending)
            **(
                {"audit": dict(Counter(o.audit for o in finals.values() if o.audit))}
                if any(o.audit for o in finals.values())
                else {}
            ),
            # NestedFP weights: choices by the weight precision they were computed at (fp16, fp8)
            **(
                {"weight_precision": dict(Counter(o.weight_precision for o in finals.values()))}
                if any(o.weight_precision for o in finals.values())
                else {}
            ),
        },
    }


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


# --- logprobs ----------------------------------------------------------------------------------------
def completion_logprobs(
    tok: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text_offset: int
) -> dict[str, Any]:
    """OpenAI's completion logprobs of `token_ids`, `entries` aligned with them (None: an unscored
    token, a prompt's first: null in token_logprobs and top_logprobs). As in vLLM, top_logprobs holds
    the token itself and the top k (k + 1 entries, k when it is among them); text_offset counts the
    token strings' characters on from `text_offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, e in zip(token_ids, entries, strict=True):
        s = tok.token_str(token_id)
        tokens.append(s)
        token_logprobs.append(None if e is None else e.logprob)
        alternatives = None
        if e is not None:
            alternatives = {s: e.logprob}
            for t, lp in e.top:
                alternatives.setdefault(tok.token_str(t), lp)
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _with_prompt(
    tok: Tokenizer, out: RequestOutput, generated: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Completions with echo and logprobs: the prompt's tokens (offsets from 0 in the echoed text)
    before the generated ones."""
    if out.prompt_logprobs is None:
        return generated
    prompt = completion_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs, 0)
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = tok.token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
        ]
    }


def _logprobs_of(job: Job, tok: Tokenizer, entries: list[TokenLogprob] | None, text_offset: int) -> Any:
    if not job.logprobs or entries is None:
        return None
    if job.kind == "completion":
        return completion_logprobs(tok, [e.token_id for e in entries], entries, text_offset)
    return chat_logprobs(tok, entries)


# --- whole responses ---------------------------------------------------------------------------------
def full_response(job: Job, tok: Tokenizer, finals: dict[str, RequestOutput]) -> dict[str, Any]:
    choices = []
    for c in job.choices:
        out = finals[c.request_id]
        logprobs = _logprobs_of(job, tok, out.logprobs, len(c.echo_text))
        if job.kind == "completion":
            choices.append(
                {
                    "index": c.index,
                    "text": c.echo_text + out.text,
                    "logprobs": _with_prompt(tok, out, logprobs),
                    "finish_reason": finish_reason(out),
                }
            )
        else:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            reason = finish_reason(out)
            if job.tool_calling is not None:
                message, reason = tools.message(job.tool_calling, out.text, reason)
            choices.append(
                {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
            )
    return {**job.head(), "choices": choices, "usage": usage(job, finals)}


# --- streamed chunks ---------------------------------------------------------------------------------
def chunk_object(job: Job) -> str:
    return "text_completion" if job.kind == "completion" else "chat.completion.chunk"


def role_chunk(job: Job, choice: Choice) -> dict[str, Any]:
    # with tool calling, content stays null unless text comes (as in whole responses)
    delta = {"role": "assistant", "content": None if job.tool_calling is not None else ""}
    return {
        **job.head(chunk_object(job)),
        "choices": [{"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}],
    }


def delta_chunk(job: Job, tok: Tokenizer, out: RequestOutput, prefix: str = "") -> dict[str, Any]:
    """The text (and logprobs) that `out` adds; `prefix` is echoed prompt text on the first chunk."""
    choice = job.choice_of(out.request_id)
    entries = out.new_logprobs if out.new_token_ids else None
    offset = len(choice.echo_text) + out.text_offset
    logprobs = _logprobs_of(job, tok, entries, offset) if entries else None
    if job.kind == "completion" and not choice.prompt_logprobs_sent:  # the choice's first chunk
        choice.prompt_logprobs_sent = True
        logprobs = _with_prompt(tok, out, logprobs)
    text = prefix + out.new_text
    body: dict[str, Any] = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish_reason(out)}
    if job.kind == "completion":
        body["text"] = text
    elif job.tool_calling is not None:
        if choice.tool_stream is None:
            choice.tool_stream = job.tool_calling.stream()
        body["delta"], body["finish_reason"] = tools.delta_body(
            choice.tool_stream, text, body["finish_reason"]
        )
    else:
        body["delta"] = {"content": text} if text else {}
    return {**job.head(chunk_object(job)), "choices": [body]}


def usage_chunk(job: Job, finals: dict[str, RequestOutput]) -> dict[str, Any]:
    return {**job.head(chunk_object(job)), "choices": [], "usage": usage(job, finals)}

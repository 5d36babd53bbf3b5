"""OutputProcessor: what a sampled token does to a request's output (stop checks, detokenizing),
and the RequestOutput deltas and final outputs built from it. Each request's output so far (its text,
logprobs, what was streamed) is a Stream `open` makes, kept in the request's record (engine/requests.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.request import FinishReason, RequestOutput, TokenLogprob
from kvserve.scheduler.sequence import ReuseReport, Sequence
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Stream:
    """A request's output so far and what of it was emitted."""

    detokenizer: IncrementalDetokenizer | None  # None for warm requests (they generate nothing)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    prompt_logprobs_emitted: bool = False  # a delta carried them (they go out once, and in the final)
    stop_reason: str | int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def open(self, seq: Sequence) -> Stream:
        """A request was accepted: its output starts (a warm's has no text)."""
        request = seq.request
        detokenizer = (
            None if request.warm_only else IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        )
        return Stream(detokenizer)

    # --- tokens ------------------------------------------------------------------------------------
    def append(
        self, seq: Sequence, out: Stream, token: int, logprob: TokenLogprob | None
    ) -> FinishReason | None:
        """Append a sampled token to the sequence and its output `out`; returns why the sequence
        finishes with it, if it does (the stop reason is recorded and a matched stop string trimmed)."""
        params = seq.request.sampling_params
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if logprob is not None:
            out.logprobs.append(logprob)
        if token in params.stop_token_ids:
            out.stop_reason = token
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        assert out.detokenizer is not None
        delta = out.detokenizer.add(token)
        out.text += delta
        if params.stop and delta and self._stop_string(seq, out, len(delta)):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _stop_string(self, seq: Sequence, out: Stream, delta_len: int) -> bool:
        params = seq.request.sampling_params
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(out.text) - delta_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in params.stop:
            idx = out.text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        out.text = out.text[: idx + len(s)] if params.include_stop_str_in_output else out.text[:idx]
        out.stop_reason = s
        return True

    @staticmethod
    def holdback(seq: Sequence) -> int:
        """Characters not yet safe to stream: they could be the start of a stop string."""
        stop = seq.request.sampling_params.stop
        return max((len(s) for s in stop), default=1) - 1 if stop else 0

    # --- outputs -----------------------------------------------------------------------------------
    def delta(self, seq: Sequence, out: Stream, weight_precision: str | None = None) -> RequestOutput | None:
        """What is new since the last emission; None if nothing is (e.g. a prefill slice)."""
        emit_to = max(out.num_emitted_chars, len(out.text) - self.holdback(seq))
        if seq.num_output_tokens == out.num_emitted_tokens and emit_to == out.num_emitted_chars:
            return None
        return self._make(seq, out, emit_to, False, weight_precision)

    def final(self, seq: Sequence, out: Stream, weight_precision: str | None = None) -> RequestOutput:
        """`weight_precision`: what its steps computed at (PrecisionPolicy.served_at)."""
        return self._make(seq, out, len(out.text), True, weight_precision)

    @staticmethod
    def _prompt_logprobs(seq: Sequence, out: Stream, finished: bool) -> list[TokenLogprob | None] | None:
        """Once every prompt token is scored: None for the first, then one per token; in the first
        output after that and in the final one."""
        if seq.request.sampling_params.prompt_logprobs is None or seq.wants_prompt_logits:
            return None
        if out.prompt_logprobs_emitted and not finished:
            return None
        out.prompt_logprobs_emitted = True
        return [None, *seq.prompt_logprobs]

    def _make(
        self, seq: Sequence, out: Stream, emit_to: int, finished: bool, weight_precision: str | None
    ) -> RequestOutput:
        reuse = seq.report or ReuseReport()
        start, end, text_offset = out.num_emitted_tokens, seq.num_output_tokens, out.num_emitted_chars
        wants_logprobs = seq.request.sampling_params.logprobs is not None
        new_logprobs = out.logprobs[start:end] if wants_logprobs else None
        out.num_emitted_tokens = end
        out.num_emitted_chars = emit_to
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.request.prompt_token_ids,
            token_ids=seq.output_token_ids if finished else [],
            text=out.text[:emit_to] if finished else "",
            new_token_ids=seq.token_ids[seq.num_prompt_tokens + start :],
            new_text=out.text[text_offset:emit_to],
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=out.stop_reason if finished else None,
            num_cached_tokens=reuse.num_exact_cached_tokens + reuse.num_approx_cached_tokens,
            num_exact_cached_tokens=reuse.num_exact_cached_tokens,
            num_approx_cached_tokens=reuse.num_approx_cached_tokens,
            num_recomputed_tokens=reuse.num_recomputed_tokens,
            compute_fraction=reuse.compute_fraction,
            reuse_plan=reuse.plan_reason,
            reuse_preset=reuse.preset,
            audit=seq.audit,
            estimated_saving=reuse.estimated_saving,
            logprobs=list(out.logprobs) if wants_logprobs and finished else None,
            prompt_logprobs=self._prompt_logprobs(seq, out, finished),
            error=seq.error if finished else None,
            metrics=seq.request.metrics,
            weight_precision=weight_precision,
            new_logprobs=new_logprobs,
            text_offset=text_offset,
        )

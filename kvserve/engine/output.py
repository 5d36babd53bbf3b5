"""Builds RequestOutput deltas and final outputs from a Sequence's state."""

from __future__ import annotations

from kvserve.request import RequestOutput
from kvserve.scheduler.sequence import Sequence


class OutputBuilder:
    def delta(self, seq: Sequence, holdback_chars: int) -> RequestOutput | None:
        """What is new since the last emission; None if nothing is (e.g. a prefill piece)."""
        outputs = seq.output_token_ids
        emit_to = max(seq.num_emitted_chars, len(seq.text) - holdback_chars)
        if len(outputs) == seq.num_emitted_tokens and emit_to == seq.num_emitted_chars:
            return None
        return self._make(seq, emit_to, finished=False)

    def final(self, seq: Sequence) -> RequestOutput:
        return self._make(seq, len(seq.text), finished=True)

    def _make(self, seq: Sequence, emit_to: int, finished: bool) -> RequestOutput:
        outputs = seq.output_token_ids
        new_token_ids = outputs[seq.num_emitted_tokens :]
        new_text = seq.text[seq.num_emitted_chars : emit_to]
        logprobs = list(seq.logprobs) if seq.request.sampling_params.logprobs is not None else None
        seq.num_emitted_tokens = len(outputs)
        seq.num_emitted_chars = emit_to
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.request.prompt_token_ids,
            token_ids=list(outputs),
            text=seq.text[:emit_to],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            num_cached_tokens=seq.num_cached_tokens + seq.num_approx_cached_tokens,
            num_exact_cached_tokens=seq.num_cached_tokens,
            num_approx_cached_tokens=seq.num_approx_cached_tokens,
            num_recomputed_tokens=seq.num_recomputed_tokens,
            compute_fraction=seq.compute_fraction,
            logprobs=logprobs,
            error=seq.error if finished else None,
            metrics=seq.request.metrics,
        )

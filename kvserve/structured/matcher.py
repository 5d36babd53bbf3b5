"""GrammarMatcher (one sequence's grammar state) and allowed_tokens (a step's masks, batched)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from kvserve.structured.items import RepeatedItems

_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32 * word + i


class GrammarMatcher:
    """Where one sequence is in its grammar. The engine feeds it every sampled token (`accept`);
    `complete` is true once the document is finished and nothing but an end-of-sequence token may
    follow, so generation stops without spending a step on that token. While the grammar still
    allows more (a number may grow another digit), end-of-sequence is allowed exactly when the
    document so far is complete, and sampling it ends the sequence as usual."""

    def __init__(
        self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int], stop_on_repeated_item: bool = False
    ):
        self._matcher = matcher
        self._eos_token_ids = frozenset(eos_token_ids)
        self._repeats = RepeatedItems() if stop_on_repeated_item else None

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token. The mask only allows tokens the grammar accepts, so a
        rejection is a bug: it raises (the engine fails that request alone)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        return bool(self._matcher.is_stopped())

    def ends(self, text: str) -> bool:
        """Whether generation ends after this token: the document is complete, or (with
        stop_on_repeated_item) `text`, the output so far, just completed an item equal to an earlier one."""
        if self._repeats is not None and self._repeats.feed(text):
            return True
        return self.complete

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher


def allowed_tokens(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The next-token masks of `matchers` (a step's constrained rows, in order) as bool
    [len(matchers), vocab_size]: True where the token is allowed. Each row's bitmask is computed on
    the calling thread (about 0.3 ms for SmolLM2's vocabulary), the rows are joined into one int32
    bitmask and unpacked in one op. Not llguidance's pointer fills (LLExecutor's parallel one or a
    matcher's own): they run on llguidance's worker threads, which waited about 24 ms per call for a
    core that torch's spinning OpenMP threads held (measured in the engine on 2 cores)."""
    words = bytearray().join(m.llmatcher.compute_bitmask() for m in matchers)
    bitmask = torch.frombuffer(words, dtype=torch.int32).view(len(matchers), -1)  # [rows, ceil(vocab / 32)]
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()

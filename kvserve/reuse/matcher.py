"""ContentMatcher: finds earlier prompts' pieces in a new prompt and plans their reuse.

Pieces are cut by the PieceCutter (fixed or content-defined), keyed by a content hash salted with
the request's cache namespace (so tenants never share), and indexed once the chunks holding their
KV are cached. Only KV computed with the true preceding context is ever indexed, and only prompts
that opted into content reuse (`reuse=any`, by request or server default) and warmed texts are
indexed: exact-only traffic pays no hashing and no index memory. The index is bounded by the store.

A match is taken only when it pays (`choose`): the CostModel prices the prompt's prefill both ways,
exact-only (every token after the prefix through every layer) and as the repair plan (the rows of its
passes, reuse/repair.py, plus moving the hits' KV), and the plan must come out at least
`reuse_min_saving` cheaper. Documents the online audit found too far off (reuse/audit.py) are not
matched at all (`guarded`).
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvserve.config_slices import ReuseConfig
from kvserve.kvcache.hashing import content_hash
from kvserve.kvcache.piece_index import Piece, PieceIndex
from kvserve.kvcache.pieces import PieceCutter
from kvserve.reuse.cost import CostModel, Work
from kvserve.reuse.plan import ContentHit, ReusePlan
from kvserve.reuse.repair import positions, query_positions, selective_positions
from kvserve.reuse.verified import AUTO_SOURCE, AutoWatch, VerifiedPreset, verified_preset

if TYPE_CHECKING:
    from kvserve.scheduler.sequence import Sequence

TAKEN = "taken"
DECLINED_SAVING = "declined: saves too little"
DECLINED_GUARD = "declined: audit guard"
# --recompute-strategy auto on a model no repair preset has been verified on (reuse/verified.py)
DECLINED_UNVERIFIED = "declined: no repair verified on this model"
DECLINED_PIECES = "declined: the repair verified on this model was measured with other --pieces"
DECLINED_FELL_BACK = "declined: auto fell back to exact serving (its audits fell below the verification's)"


@dataclass
class Choice:
    plan: ReusePlan | None  # None: declined, the prompt is prefilled with exact reuse only
    outcome: str  # TAKEN or DECLINED_*
    saving: float  # estimated: 1 - plan seconds / exact-only seconds
    num_guarded: int  # matches left out because the audit guard blocks their document


@dataclass
class PromptPieces:
    """A prompt's pieces for content matching and how many are indexed so far."""

    pieces: list[tuple[int, int]]
    keys: list[bytes]  # each piece's content hash, salted with the request's namespace
    source_id: int  # unique per prompt: identifies runs of pieces from one prompt (piece_index.py)
    num_registered: int = 0


@dataclass(frozen=True)
class MatcherStats:
    available: bool
    reason: str
    default_reuse: str
    recompute_strategy: str
    auto: dict[str, Any]  # auto's verified preset and its online watch (reuse/verified.py: AutoWatch)
    pieces: str
    num_indexed_pieces: int
    num_approx_hit_tokens: int
    num_recomputed_tokens: int
    plans: dict[str, int]  # prompts with content matches by decision: "taken" or "declined: <why>"
    num_guarded_documents: int
    num_guard_skips: int  # matches skipped because their document is guarded


class ContentMatcher:
    def __init__(
        self,
        config: ReuseConfig,
        model: str,  # the model's name: auto's verified preset is looked up by it
        chunk_size: int,
        max_num_batched_tokens: int,
        index: PieceIndex,
        cost: CostModel,
        enabled: bool,
        disabled_reason: str = "",
        line_ends: Callable[[], frozenset[int]] = frozenset,
    ):
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.index = index
        self._line_ends = line_ends  # --pieces lines: the tokenizer's line-ending ids, found at the first cut
        self.enabled = enabled  # the model supports moving KV and the start-up self-check passed
        self.disabled_reason = disabled_reason
        self.chunk_size = chunk_size
        self.cost = cost
        self.num_hit_tokens = 0  # reused through content matches (before repair)
        self.num_recomputed_tokens = 0
        self.plans: Counter[str] = Counter()  # TAKEN / DECLINED_* -> prompts (first admission only)
        self.guarded: set[bytes] = set()  # content keys the audit guard stopped reusing
        self.num_guard_skips = 0  # matches skipped because their document is guarded
        # what --recompute-strategy auto repairs with, watched by the online audits
        self.auto = AutoWatch(verified_preset(model, config.verified_presets))
        self._prompts: dict[str, PromptPieces] = {}  # request id -> its pieces (prepared, not finished)
        self._source_ids = itertools.count(1)

    @functools.cached_property
    def cutter(self) -> PieceCutter:
        """Made at the first prompt cut (at start-up when the server's --reuse is any): finding the line
        ends decodes every token (0.8 s for SmolLM2's 49,152), which a server that cuts no prompt
        should not pay."""
        cfg = self.config
        line_ends = self._line_ends() if cfg.pieces == "lines" else frozenset()
        return PieceCutter(cfg.pieces, self.chunk_size, cfg.piece_min_tokens, cfg.piece_max_tokens, line_ends)

    def _mode(self, seq: Sequence) -> str:
        opts = seq.request.reuse
        return opts.reuse if opts is not None and opts.reuse is not None else self.config.reuse

    def prepare(self, seq: Sequence) -> None:
        """Cut the prompt into pieces if it will be indexed (warmed, or opted into content reuse): kept
        here by request id until `forget`."""
        if self.enabled and (seq.request.warm_only or self._mode(seq) == "any"):
            tokens = seq.request.prompt_token_ids
            pieces = self.cutter.cut(tokens)
            salt = seq.cache.root_hash.hex()
            keys = [content_hash(salt, tokens[start:end]) for start, end in pieces]
            self._prompts[seq.request_id] = PromptPieces(pieces, keys, next(self._source_ids))

    def request_ids(self) -> set[str]:
        return set(self._prompts)

    def forget(self, request_id: str) -> None:
        """The request finished: its pieces are indexed or never will be."""
        self._prompts.pop(request_id, None)

    def wants(self, seq: Sequence) -> bool:
        """Whether to look for content matches for this sequence (never for prompt logprobs: they are
        computed on exact KV only)."""
        exact_only = seq.request.warm_only or seq.request.sampling_params.prompt_logprobs is not None
        return self.enabled and not exact_only and self._mode(seq) == "any"

    def find_matches(self, seq: Sequence, prefix_len: int) -> list[tuple[int, bytes]]:
        """(start, content key) of the indexed pieces after the exact prefix; the last prompt token is
        always computed."""
        prompt = self._prompts.get(seq.request_id)
        if prompt is None:
            return []
        last = seq.num_prompt_tokens - 1
        return [
            (start, key)
            for (start, end), key in zip(prompt.pieces, prompt.keys, strict=True)
            if start >= prefix_len and end <= last and key in self.index
        ]

    # --- cost-aware choice -------------------------------------------------------------------------
    def _steps(self, *rows: int) -> int:
        """Steps the passes of these many rows take, one after the other, under the step budget."""
        budget = self.max_num_batched_tokens
        return sum(-(-r // budget) for r in rows if r > 0)

    def exact_work(self, prefix_len: int, n: int) -> Work:
        """Exact-only reuse: every token after the exact prefix through every layer."""
        work = Work(steps=self._steps(n - prefix_len))
        work.add_span(prefix_len, n, self.cost.num_layers)
        return work

    def plan_work(self, plan: ReusePlan, n: int) -> Work:
        """The plan's passes (reuse/repair.py) and the moving of its hits' KV. CacheBlend's second
        pass is not chosen yet: it is priced as the fresh tokens plus `ratio` of the reused ones at
        their mean position; so is query-aware repair's, after its first pass (the fresh rows through
        the probe's layers) and the probe."""
        layers = self.cost.num_layers
        reused, fresh = positions(plan, n)
        work = Work(moved=len(reused) * layers)
        if plan.strategy == "cacheblend":
            work.add_span(plan.prefix_len, n, min(plan.check_layer + 1, layers))
            chosen = round(plan.recompute_ratio * len(reused))
            mean = sum(reused) / len(reused) if reused else 0.0
            work.add_rows(sum(fresh) + chosen * mean, len(fresh) + chosen, layers)
            work.steps = self._steps(n - plan.prefix_len, len(fresh) + chosen)
            return work
        if plan.strategy == "query":  # fresh rows through the probe's layers, then fresh + marks + ratio
            work.add_rows(sum(fresh), len(fresh), min(plan.check_layer + 1, layers))
            marks = selective_positions(plan, reused)
            chosen = round(plan.recompute_ratio * (len(reused) - len(marks)))
            mean = sum(reused) / len(reused) if reused else 0.0
            work.add_rows(sum(fresh) + sum(marks) + chosen * mean, len(fresh) + len(marks) + chosen, layers)
            probed = len(query_positions(reused, fresh))
            work.attend += probed * n  # the probe's scores: probed rows x the context, at one layer
            work.steps = self._steps(len(fresh), len(fresh) + len(marks) + chosen)
            return work
        rows = fresh + (selective_positions(plan, reused) if plan.strategy == "selective" else [])
        work.add_rows(sum(rows), len(rows), layers)
        work.steps = self._steps(len(rows))
        return work

    def choose(self, plan: ReusePlan, n: int) -> tuple[str, float]:
        """(TAKEN or why not, estimated saving: 1 - plan seconds / exact-only seconds)."""
        exact = self.cost.seconds(self.exact_work(plan.prefix_len, n))
        saving = 1.0 - self.cost.seconds(self.plan_work(plan, n)) / exact
        if saving < self.config.reuse_min_saving:
            return DECLINED_SAVING, saving
        return TAKEN, saving

    def consider(self, seq: Sequence, prefix_len: int) -> Choice | None:
        """What to do with the prompt's matches after the exact prefix (None: there are none). No
        side effects: admission may consider a sequence several times before it starts. A match
        declined before planning (guarded, or `auto` serving exactly) costs a set lookup per piece."""
        found = self.find_matches(seq, prefix_len)
        if not found:
            return None
        matches = [(start, key) for start, key in found if key not in self.guarded]
        if not matches:
            return Choice(None, DECLINED_GUARD, 0.0, len(found))
        repair = self.repair_for(seq)
        if isinstance(repair, str):
            return Choice(None, repair, 0.0, len(found) - len(matches))
        hits = [ContentHit(start, self.index.lookup(key), key) for start, key in matches]
        plan = self.plan(seq, prefix_len, hits, repair)
        outcome, saving = self.choose(plan, seq.num_prompt_tokens)
        return Choice(plan if outcome == TAKEN else None, outcome, saving, len(found) - len(matches))

    def record(self, seq: Sequence, choice: Choice) -> None:
        """The decision at a sequence's first admission with matches (a re-admission keeps it)."""
        assert seq.report is not None  # recorded at admission
        if seq.report.plan is not None:
            return
        plan = "taken" if choice.outcome == TAKEN else "declined"
        seq.report = replace(
            seq.report,
            plan=plan,
            plan_reason=choice.outcome,
            estimated_saving=choice.saving,
            preset=choice.plan.preset if choice.plan is not None else None,
        )
        self.plans[choice.outcome] += 1
        self.num_guard_skips += choice.num_guarded

    def auto_preset(self) -> VerifiedPreset | str:
        """What `auto` repairs with now, or why it serves exactly (a DECLINED_* reason)."""
        preset = self.auto.active()
        if preset is not None and preset.pieces == self.config.pieces:
            return preset
        if self.auto.fell_back:
            return DECLINED_FELL_BACK
        return DECLINED_UNVERIFIED if self.auto.preset is None else DECLINED_PIECES

    def repair_for(self, seq: Sequence) -> tuple[str, Any] | str:
        """Where the request's repair comes from and the verified preset's options (None unless
        `auto` picked it); a str: `auto` serves exactly, and why."""
        opts = seq.request.reuse
        if opts is not None and opts.recompute_strategy is not None:
            return "named by the request", None
        if self.config.recompute_strategy != "auto":
            return f"the server's --recompute-strategy {self.config.recompute_strategy}", None
        verified = self.auto_preset()
        if isinstance(verified, str):
            return verified
        return AUTO_SOURCE + verified.describe(), verified.options

    def plan(
        self, seq: Sequence, prefix_len: int, hits: list[ContentHit], repair: tuple[str, Any]
    ) -> ReusePlan:
        """The request's repair (its fields, else the preset's, else the server's) over `hits`."""
        opts = seq.request.reuse
        cfg = self.config
        source, preset = repair

        def pick(name: str) -> Any:
            for given in (opts, preset):
                value = getattr(given, name, None) if given is not None else None
                if value is not None:
                    return value
            return getattr(cfg, name)

        return ReusePlan(
            seq=seq,
            prefix_len=prefix_len,
            hits=hits,
            strategy=str(pick("recompute_strategy")),
            recompute_tokens=int(pick("recompute_tokens")),
            sink_tokens=cfg.sink_tokens,
            overlap_tokens=cfg.overlap_tokens,
            check_layer=int(pick("blend_check_layer")),
            seam_tokens=int(pick("blend_seam_tokens")),
            recompute_ratio=float(pick("recompute_ratio")),
            preset=source,
        )

    def stats(self) -> MatcherStats:
        cfg = self.config
        return MatcherStats(
            available=self.enabled,
            reason=self.disabled_reason,
            default_reuse=cfg.reuse,
            recompute_strategy=cfg.recompute_strategy,
            auto=self.auto.stats(),
            pieces=cfg.pieces,
            num_indexed_pieces=len(self.index),
            num_approx_hit_tokens=self.num_hit_tokens,
            num_recomputed_tokens=self.num_recomputed_tokens,
            plans=dict(self.plans),
            num_guarded_documents=len(self.guarded),
            num_guard_skips=self.num_guard_skips,
        )

    def register(self, seq: Sequence, num_held_tokens: int, chunk_hashes: list[bytes]) -> None:
        """Index the prompt pieces whose KV now lies in cached chunks: [0, num_held_tokens) is held
        by chunk_hashes (one per chunk_size tokens, the last may be a tail)."""
        prompt = self._prompts.get(seq.request_id)
        if prompt is None:
            return
        while prompt.num_registered < len(prompt.pieces):
            start, end = prompt.pieces[prompt.num_registered]
            if end > num_held_tokens:
                break
            first, last = start // self.chunk_size, (end - 1) // self.chunk_size
            self.index.add(
                Piece(
                    content_hash=prompt.keys[prompt.num_registered],
                    start_pos=start,
                    num_tokens=end - start,
                    chunk_hashes=tuple(chunk_hashes[first : last + 1]),
                    first_chunk_pos=first * self.chunk_size,
                    source_id=prompt.source_id,
                    warmed=seq.request.warm_only,
                )
            )
            prompt.num_registered += 1

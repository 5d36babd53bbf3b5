"""Intake: a request's checks, in one place, and the Sequence it becomes.

`check` holds every check that needs no engine state (context length, vocabulary, pool size, reuse
and precision support, structured output): the server runs it once before it queues a request (off
the engine thread), and the engine runs it only for callers that did not (the LLM API). The checks
that need the engine's state (a request id in use, the pinned share of the pool) run on the engine
thread when the request is added. A refused request changes nothing.
"""

from __future__ import annotations

import random
import time

import torch

from kvserve.config import ServeConfig
from kvserve.engine.builder import RuntimeInfo
from kvserve.engine.pins import PinnedText, WarmPins
from kvserve.engine.precision import PRECISIONS, PrecisionPolicy
from kvserve.engine.requests import RequestRecord
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import root_hash
from kvserve.kvcache.manager import KVCacheManager
from kvserve.request import Request, check_token_ids
from kvserve.reuse import ContentReuse, check_reuse_request
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import SeqCache, Sequence
from kvserve.structured import GrammarCompiler


class Intake:
    def __init__(
        self,
        config: ServeConfig,
        info: RuntimeInfo,
        kv: KVCacheManager,
        scheduler: Scheduler,
        reuse: ContentReuse,
        precision: PrecisionPolicy,
        grammars: GrammarCompiler,
        pins: WarmPins,
    ):
        self.config, self.info = config, info
        self.kv, self.scheduler, self.reuse = kv, scheduler, reuse
        self.precision, self.grammars, self.pins = precision, grammars, pins
        self._rng = random.Random(config.seed)

    # --- checks ------------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """The checks that need no engine state: safe from any thread. Raises InvalidRequestError."""
        n = len(request.prompt_token_ids)
        limit = self.info.max_model_len
        if not request.warm_only:
            check_reuse_request(
                request.reuse, self.reuse.enabled, self.reuse.disabled_reason, self.config.reuse
            )
        if n == 0 and not request.warm_only:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        if n >= limit and not request.warm_only:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the model's context is {limit}: "
                f"shorten it to at most {limit - 1} tokens so one can be generated",
                param="prompt",
            )
        if n > limit:
            raise InvalidRequestError(
                f"the text has {n} tokens; at most {limit} can be warmed", param="prompt"
            )
        if request.weight_precision is not None and (
            not self.precision.nested or request.weight_precision not in PRECISIONS
        ):
            raise InvalidRequestError(
                f"weight_precision {request.weight_precision!r} is not served here (server: "
                f"--weight-precision {self.config.weight_precision})",
                param="weight_precision",
            )
        check_token_ids(request.prompt_token_ids, self.info.vocab_size, "prompt")
        request.sampling_params.check_vocab(self.info.vocab_size)
        structured = request.sampling_params.structured
        if structured is not None and not request.warm_only:
            if request.sampling_params.ignore_eos:
                raise InvalidRequestError(
                    f"ignore_eos cannot be combined with {structured.source}: a structured output ends "
                    "when its document is complete; drop ignore_eos",
                    param="ignore_eos",
                )
        need_tokens = n if request.warm_only else min(n + request.sampling_params.max_tokens, limit)
        if self.kv.max_blocks(need_tokens, self.config.max_num_batched_tokens) > self.kv.pool.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need_tokens} tokens of KV but the pool holds {self.info.pool_tokens}; "
                "raise max_cache_bytes or lower max_tokens",
                param="max_tokens",
            )

    def check_grammar(self, request: Request) -> None:
        """An invalid schema is a 400. AsyncEngine compiled it on GrammarWorker's threads (this finds
        it compiled); the LLM API compiles it here, on the engine thread."""
        structured = request.sampling_params.structured
        if structured is not None and not request.warm_only:
            self.grammars.check(structured)

    def check_capacity(self, seq: Sequence) -> None:
        """The request's KV at its longest must fit in what the pool can ever free for it beside the
        chunks warmed texts pinned (`check` checked the pool's size)."""
        request = seq.request
        need_tokens = min(seq.num_prompt_tokens + request.sampling_params.max_tokens, self.info.max_model_len)
        if request.warm_only:
            need_tokens = seq.num_prompt_tokens
        need_blocks = -(-need_tokens // self.config.block_size)
        available = self.kv.num_blocks_available_to(self.kv.match(seq.cache.prefix_hashes))
        if need_blocks > available:
            raise InvalidRequestError(
                f"the request needs {need_blocks} KV blocks but only {available} of the pool's "
                f"{self.kv.pool.num_blocks} can be free: {self.kv.store.num_pinned_blocks} are pinned by "
                "warmed text; unpin some (DELETE /v1/warm) or lower max_tokens",
                param="max_tokens",
            )

    # --- sequences ---------------------------------------------------------------------------------
    def root(self, cache_salt: str | None, precision: str | None) -> bytes:
        """The root of a request's chunk hashes: the engine's namespace, the weight precision its KV is
        computed at (NestedFP), its cache salt."""
        namespace = self.info.namespace if precision is None else f"{self.info.namespace}|{precision}"
        return root_hash(namespace, cache_salt)

    def sequence(self, request: Request) -> RequestRecord:
        """The record of the sequence a checked request becomes: its weight precision, hashes, seed
        and grammar, and a pinning warm's booking. Raises InvalidRequestError when pinned chunks leave it no
        room, or pinning it would pass the pin cap."""
        precision = request.weight_precision or self.precision.assign(
            len(self.scheduler.waiting), time.monotonic()
        )
        root = self.root(request.cache_salt, precision)
        # a pinning warm's owner names the text as sent (DELETE /v1/warm sends it again)
        pinning = request.warm_only and request.pin
        pinned = PinnedText(request.prompt_token_ids, request.cache_salt, precision) if pinning else None
        if request.warm_only and not self.reuse.enabled:  # only whole chunks can be prefix-matched
            usable = len(request.prompt_token_ids) // self.config.chunk_size * self.config.chunk_size
            request.prompt_token_ids = request.prompt_token_ids[:usable]
        params = request.sampling_params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = self._new(request, root, seed)
        seq.precision = precision
        if params.structured is not None and not request.warm_only:
            seq.grammar = self.grammars.matcher(params.structured)
        self.check_capacity(seq)
        booking = self.pins.reserve(seq, pinned) if pinned is not None else None  # last: a 400 past the cap
        return RequestRecord(seq, pin=booking)

    def background(self, request: Request) -> RequestRecord:
        """An audit's recompute: no client, no output, the served request's precision."""
        seq = self._new(request, self.root(request.cache_salt, request.weight_precision), 0)
        seq.precision = request.weight_precision
        return RequestRecord(seq)

    def _new(self, request: Request, root: bytes, seed: int) -> Sequence:
        """A sequence for `request`, its prompt hashed (Scheduler.prepare), not yet queued."""
        seq = Sequence(request, torch.Generator().manual_seed(seed), SeqCache(root))
        self.scheduler.prepare(seq)
        return seq

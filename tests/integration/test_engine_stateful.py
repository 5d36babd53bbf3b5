"""A stateful property test of the Engine: random adds (prefix and content reuse, n > 1, stop
strings, logit_bias, seeds, cache salts), bad inputs, aborts, warms, pins, unpins and steps on a tiny
pool that forces chunked prefill, preemption and eviction, for several KV codecs.

After every step: pool and chunk-store integrity (reference counts equal holders, no cached chunk
unreachable, pins and reservations balanced, in-flight chunks and the content index consistent).
Every finished request either completed, was aborted by the test, or failed because of its own input
(or was refused because pinned memory left it too little room). Every greedy request under exact
reuse that completed equals a cache-off engine's output, token for token. At the end of each example
the engine is drained: everything aborted and unpinned, the cache evicted, and the pool is back to
all blocks free.

`make test` runs a bounded profile (about two minutes); `KVSERVE_STATEFUL_PROFILE=slow` (the `slow`
test below) runs far more examples.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import Engine
from kvserve.errors import InvalidRequestError
from kvserve.request import FinishReason, Request, RequestOutput, ReuseOptions
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
POOL_BLOCKS = 30  # 480 tokens: a handful of requests fill it
MAX_NUM_SEQS = 4
CODECS = ("auto", "bf16", "fp8_e4m3", "int8", "int4", "turbo4")
# (model, codec): tiny-random-llama under every codec; tiny-random-gemma3's sliding-window layers keep
# only their window in the pool (kvcache/layout.py), which preemption, eviction and pins must respect
CASES = (
    *(("tiny-random-llama", c) for c in CODECS),
    ("tiny-random-gemma3", "auto"),
    ("tiny-random-gemma3", "int8"),
)
SALTS = (None, "tenant-a", "tenant-b")

_ENGINES: dict[tuple[str, str], tuple[LLM, LLM]] = {}
_REFERENCE: dict[tuple[str, str, tuple[int, ...], str], list[int]] = {}


def engines(model: str, codec: str) -> tuple[LLM, LLM]:
    """(cached engine with a tiny pool, cache-off reference engine), built once per model and codec."""
    if (model, codec) not in _ENGINES:
        common = dict(model=model, chunk_size=CHUNK, kv_cache_dtype=codec, pieces="fixed")
        tiny = LLM(
            max_cache_bytes=_budget(codec, POOL_BLOCKS),
            max_num_batched_tokens=64,
            max_num_seqs=MAX_NUM_SEQS,
            max_pinned_fraction=0.5,
            reuse_min_saving=-10.0,  # take every content match: the repairs are what is checked
            **common,
        )
        layout = tiny.engine.kv.layout
        assert layout is not None
        # a block holds one layer group's KV: the same bytes hold 4 blocks of one-layer groups
        assert tiny.engine.pool.num_blocks == POOL_BLOCKS * 4 // layout.num_slots, tiny.engine.pool.num_blocks
        cold = LLM(max_cache_bytes=20_000_000, enable_prefix_caching=False, **common)
        _ENGINES[(model, codec)] = (tiny, cold)
    return _ENGINES[(model, codec)]


def _budget(codec: str, num_blocks: int) -> int:
    """max_cache_bytes giving `num_blocks` blocks of a tiny random model's KV (4 layers, 2 KV heads,
    head_dim 16, every layer in one block) in `codec`, plus what a block codec reserves for open blocks (engine/builder.py)."""
    import torch

    from kvserve.kvcache.quantized_storage import create_layer_kv

    layer = create_layer_kv(codec, 1, 16, 2, 16, torch.float32, torch.device("cpu"))
    codec_k = getattr(getattr(layer, "codec", None), "k", None)
    open_blocks = MAX_NUM_SEQS * 16 * 2 * 16 * 4 * 4 if codec_k is not None and not codec_k.per_token else 0
    return num_blocks * layer.bytes_per_block() * 4 + open_blocks


def pieces(llm: LLM) -> dict[str, list[int]]:
    """Reusable prompt material: a system prompt, documents, questions (real English)."""
    return {
        "system": corpus_token_ids(llm, 40, seed=900),
        **{f"doc{i}": corpus_token_ids(llm, 36 + 11 * i, seed=910 + i) for i in range(4)},
        **{f"q{i}": corpus_token_ids(llm, 3 + 4 * i, seed=930 + i) for i in range(4)},
    }


def reset(engine: Engine) -> None:
    """Back to an empty cache: abort everything, release every pin, evict every chunk."""
    engine.abort_all("reset")
    while engine.has_unfinished_requests():
        engine.step()
    for owner in engine.store.pin_owners():
        engine.store.unpin(owner)
    engine.store.evict(engine.pool.num_blocks)


prompt_shapes = st.tuples(
    st.booleans(),  # with the system prompt
    st.lists(st.integers(0, 3), max_size=3, unique=True),  # documents, in this order
    st.integers(0, 3),  # the question
)
param_sets = st.fixed_dictionaries(
    {
        "max_tokens": st.integers(1, 12),
        "greedy": st.booleans(),
        "seed": st.integers(0, 2**31),
        "stop": st.sampled_from([(), (" the",), ("e", ".")]),
        "logit_bias": st.sampled_from([None, {100: 3.0}, {7: -100.0, 1000: 2.0}]),
    }
)
reuse_modes = st.sampled_from(
    [
        None,
        ReuseOptions(reuse="any", recompute_strategy="none"),
        ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=4),
        ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0),
    ]
)


class EngineMachine(RuleBasedStateMachine):
    @initialize(case=st.sampled_from(CASES))
    def setup(self, case: tuple[str, str]) -> None:
        self.model, self.codec = case
        self.llm, self.cold = engines(*case)
        self.engine = self.llm.engine
        reset(self.engine)  # a failed example may have left requests or pins behind
        self.engine.check_integrity_each_step = True
        self.pieces = pieces(self.llm)
        self.ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.unfinished: set[str] = set()
        self.aborted: set[str] = set()
        self.pinned: set[tuple[tuple[int, ...], str | None]] = set()
        self.ever_pinned: set[tuple[tuple[int, ...], str | None]] = set()  # a warm may pin after an unpin

    # --- helpers -----------------------------------------------------------------------------------
    def _prompt(self, shape: tuple[bool, list[int], int]) -> list[int]:
        system, docs, question = shape
        tokens = list(self.pieces["system"]) if system else []
        for d in docs:
            tokens += self.pieces[f"doc{d}"]
        return tokens + self.pieces[f"q{question}"]

    def _collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._check_finished(out)

    def _check_finished(self, out: RequestOutput) -> None:
        rid = out.request_id
        self.unfinished.discard(rid)
        request = self.requests.pop(rid)
        if rid in self.aborted:
            assert out.finish_reason in (FinishReason.ABORT, FinishReason.STOP, FinishReason.LENGTH)
            return
        if out.finish_reason == FinishReason.ERROR:
            error = out.error or ""
            assert "pinned" in error or "max_pinned_fraction" in error, f"{rid} failed: {error}"
            return
        assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), out
        params = request.sampling_params
        exact = request.reuse is None  # the server default here is prefix-only reuse
        if request.warm_only or not params.greedy or not exact:
            return
        key = (self.model, self.codec, tuple(request.prompt_token_ids), repr(params))
        if key not in _REFERENCE:
            (ref,) = self.cold.generate([request.prompt_token_ids], params)
            _REFERENCE[key] = ref.token_ids
        assert out.token_ids == _REFERENCE[key], f"{rid}: cached output differs from the cache-off engine"

    # --- rules -------------------------------------------------------------------------------------
    @rule(
        shape=prompt_shapes, p=param_sets, reuse=reuse_modes, salt=st.sampled_from(SALTS), n=st.integers(1, 3)
    )
    def add(self, shape, p, reuse, salt, n) -> None:  # type: ignore[no-untyped-def]
        prompt = self._prompt(shape)
        if not self.engine.reuse.matcher.enabled:  # declined on this model (sliding-window layers)
            reuse = None
        for i in range(n):
            params = SamplingParams(
                max_tokens=p["max_tokens"],
                temperature=0.0 if p["greedy"] else 0.9,
                seed=p["seed"] + i,
                stop=p["stop"],
                logit_bias=p["logit_bias"],
                ignore_eos=True,
            )
            rid = f"r{next(self.ids)}"
            request = Request(rid, list(prompt), params, cache_salt=salt, reuse=reuse)
            self.engine.add_request(request)
            self.requests[rid] = request
            self.unfinished.add(rid)

    @rule(kind=st.sampled_from(["oov", "empty", "too_long", "too_much_kv", "duplicate_id"]))
    def add_bad(self, kind: str) -> None:
        engine = self.engine
        before = (engine.pool.num_free_blocks, engine.scheduler.num_unfinished, len(engine.store))
        limit = engine.info.max_model_len
        prompt, params, rid = [1, 2, 3], SamplingParams(max_tokens=4), f"bad{next(self.ids)}"
        if kind == "oov":
            prompt = [1, engine.tokenizer.vocab_size + 3]
        elif kind == "empty":
            prompt = []
        elif kind == "too_long":
            prompt = [5] * limit
        elif kind == "too_much_kv":
            params = SamplingParams(max_tokens=engine.pool.num_blocks * 16 + 1)
        elif kind == "duplicate_id" and self.unfinished:
            rid = sorted(self.unfinished)[0]
        else:
            return
        with pytest.raises(InvalidRequestError):
            engine.add_request(Request(rid, prompt, params))
        assert (engine.pool.num_free_blocks, engine.scheduler.num_unfinished, len(engine.store)) == before

    @precondition(lambda self: bool(self.unfinished))
    @rule(data=st.data())
    def abort(self, data) -> None:  # type: ignore[no-untyped-def]
        rid = data.draw(st.sampled_from(sorted(self.unfinished)))
        self.aborted.add(rid)
        self.engine.abort_request(rid, "aborted by the test")

    @rule(shape=prompt_shapes, pin=st.booleans(), salt=st.sampled_from(SALTS))
    def warm(self, shape, pin: bool, salt) -> None:  # type: ignore[no-untyped-def]
        text = self._prompt(shape)
        rid = f"w{next(self.ids)}"
        request = Request(rid, text, SamplingParams(max_tokens=1), cache_salt=salt, warm_only=True, pin=pin)
        try:
            self.engine.add_request(request)
        except InvalidRequestError as e:
            assert "max_pinned_fraction" in e.message or "pinned" in e.message, e.message
            return
        self.requests[rid] = request
        self.unfinished.add(rid)
        if pin:
            self.pinned.add((tuple(text), salt))
            self.ever_pinned.add((tuple(text), salt))

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data) -> None:  # type: ignore[no-untyped-def]
        text, salt = data.draw(st.sampled_from(sorted(self.pinned, key=repr)))
        released = self.engine.unpin(list(text), salt)
        assert released >= 0 and self.engine.unpin(list(text), salt) == 0
        self.pinned.discard((text, salt))

    @rule(k=st.integers(1, 6))
    def step(self, k: int) -> None:
        for _ in range(k):
            self._collect(self.engine.step())

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "engine"):
            self.engine.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        for rid in sorted(self.unfinished):
            self.aborted.add(rid)
            engine.abort_request(rid, "test teardown")
        while engine.has_unfinished_requests():
            self._collect(engine.step())
        assert not self.unfinished, f"requests never finished: {sorted(self.unfinished)}"
        for text, salt in self.ever_pinned:
            engine.unpin(list(text), salt)
        assert engine.store.num_pin_owners == 0 and engine.store.num_reserved_pin_blocks == 0
        engine.store.evict(engine.pool.num_blocks)
        engine.check_integrity()
        assert len(engine.store) == 0 and engine.pool.num_free_blocks == engine.pool.num_blocks
        assert len(engine.reuse.matcher.index) == 0


PROFILES = {
    "default": settings(
        max_examples=12, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    ),
    "slow": settings(
        max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)
    ),
}


def test_engine_state_machine() -> None:
    profile = os.environ.get("KVSERVE_STATEFUL_PROFILE", "default")
    EngineMachine.TestCase.settings = PROFILES[profile]
    EngineMachine.TestCase("runTest").runTest()


@pytest.mark.slow
def test_engine_state_machine_long() -> None:
    EngineMachine.TestCase.settings = PROFILES["slow"]
    EngineMachine.TestCase("runTest").runTest()

"""Batch invariance under every KV codec (issue 11, symptom 14), on CPU with the CPU extension.

A request's logits must be bitwise the same whether its prompt was computed cold, warm on top of
cached chunks (a full hit recomputing only the last token, or a short suffix), in prefill slices of
another size, batched with identical requests, or decoded next to another sequence's long prefill.
With a quantized KV cache this is what makes warm == cold hold at all: a last-bit difference in a K
value flips a rounding of the quantizer now and then, and the flip changes greedy tokens. The
guarantee rests on the extension's attention and linear kernels (docs/kernels.md); without a C++
compiler the torch-ops fallback is not invariant and these tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ext
from kvserve.request import Request
from tests.integration.helpers import corpus_token_ids, generate_with_logits

CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# fp32 is the default (kv_cache_dtype auto under fp32 compute); mxfp4 needs head_dim % 32 == 0: slow variant
CODECS = ["auto", "bf16", "fp16", "fp8_e4m3", "int8", "int4", "int2", "nvfp4", "turbo4", "turbo3.5", "turbo3"]
CODECS += ["turbo2"]
# mixed K/V codecs: both kinds of K (KIVI's per block, a rotation's per token) beside a per-token V
CODECS += ["kint3-vturbo3", "kturbo4-vturbo2", "kint2-vturbo2"]
# KIVI K with 8-bit scale and zero (kivi.py meta_bits 8), alone and beside turbo2.5's V
CODECS += ["int4dq", "kint3dq-vturbo2.5"]
# bf16 compute (the dtype auto picks on CPUs with AMX / AVX-512 BF16): linear through row_linear_bf16, KV
# in bf16 (auto) or quantized from bf16 rows; one codec of each reader and quantizer family
BF16_CODECS = ["auto", "fp8_e4m3", "int8", "int4", "int4dq", "turbo4"]
# KIVI K is quantized per block when the block fills; until then rows read its exact K. These tests
# hold for KIVI because the scheduler ends every prefill slice but a prompt's last on a block boundary
# (Scheduler._piece_len): test_decode_next_to_long_prefill fails for int8/int4/int2 without it.

pytestmark = pytest.mark.skipif(
    bool(cpu_ext.unavailable_reason()), reason="batch invariance needs the CPU extension (a C++ compiler)"
)


def _engines(
    model: str, codec: str, chunk: int = CHUNK, dtype: str = "float32", decoded_bytes: int = 0
) -> tuple[LLM, LLM]:
    """(cached engine, cold engine with prefix caching off and a smaller prefill budget, so that its
    prompts are cut into pieces at other points); the cached one keeps `decoded_bytes` of decoded
    blocks across steps (kv_decoded_bytes), the cold one decodes every block every step."""
    common = dict(
        model=model,
        dtype=dtype,
        kv_cache_dtype=codec,
        chunk_size=chunk,
        block_size=16,
        max_cache_bytes=50_000_000,
    )
    cached = LLM(
        enable_prefix_caching=True, max_num_batched_tokens=512, kv_decoded_bytes=decoded_bytes, **common
    )
    cold = LLM(enable_prefix_caching=False, max_num_batched_tokens=48, **common)
    for llm in (cached, cold):
        llm.engine.check_integrity_each_step = True
    return cached, cold


def _same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, what
        if not torch.equal(g, w):
            step = next(s for s in range(len(g)) if not torch.equal(g[s], w[s]))
            diff = (g[step] - w[step]).abs().max().item()
            raise AssertionError(f"{what}: output {i} differs from step {step} on (max |diff| {diff:.3g})")


def check_warm_equals_cold(cached: LLM, cold: LLM, prompt_len: int, seed: int, chunk: int = CHUNK) -> None:
    """Warm (full hit: only the last token recomputed; suffixes of 1, 5 and 16 new tokens; the same
    prompt again) == cold, bitwise."""
    base = corpus_token_ids(cached, prompt_len, seed=seed)
    full = base[: (len(base) - 1) // chunk * chunk + 1]  # whole chunks + 1 token
    cases = {
        "first run": base,
        "same prompt again": base,
        "full hit, last token recomputed": full,
        **{
            f"{n}-token suffix": base[: 2 * chunk] + corpus_token_ids(cached, n, seed=seed + n)
            for n in (1, 5, 16)
        },
    }
    for name, prompt in cases.items():
        (warm,), warm_logits = generate_with_logits(cached, [prompt], GREEDY)
        (ref,), ref_logits = generate_with_logits(cold, [prompt], GREEDY)
        if name == "full hit, last token recomputed":
            assert warm.num_cached_tokens == len(prompt) - 1, name
        _same(warm_logits, ref_logits, f"warm != cold ({name}, {warm.num_cached_tokens} cached)")
        assert warm.token_ids == ref.token_ids, name


def check_together_equals_alone(cached: LLM, cold: LLM, prompt_len: int, seed: int, n: int = 4) -> None:
    """n identical requests at once == the same request alone, with the cache on and off."""
    prompt = corpus_token_ids(cached, prompt_len, seed=seed)
    _, alone = generate_with_logits(cold, [prompt], GREEDY)
    for llm in (cold, cached):
        _, together = generate_with_logits(llm, [prompt] * n, GREEDY)
        _same(
            together, alone * n, f"{n} together != alone (prefix caching {llm.config.enable_prefix_caching})"
        )


def _logits_with_salt(
    llm: LLM, prompt: list[int], params: SamplingParams, salt: str
) -> tuple[list[int], list[torch.Tensor]]:
    llm.engine.update.logits_sink = {}
    try:
        (out,) = llm.generate([prompt], params, cache_salt=salt)
        return out.token_ids, [torch.stack(llm.engine.update.logits_sink[out.request_id])]
    finally:
        llm.engine.update.logits_sink = None


def check_decode_next_to_prefill(llm: LLM, short_len: int, long_len: int, seed: int) -> None:
    """A sequence decoding while another's long prefill shares its steps == that sequence alone, and the
    long prompt (cut into pieces where the decode row took a token of the step's budget) == alone."""
    short = corpus_token_ids(llm, short_len, seed=seed)
    long = corpus_token_ids(llm, long_len, seed=seed + 1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    _, alone = generate_with_logits(llm, [short], params)
    _, long_alone = _logits_with_salt(llm, long, long_params, "alone")  # its chunks stay out of reach
    engine = llm.engine
    engine.update.logits_sink = {}
    try:
        engine.add_request(Request("short", list(short), params))
        for _ in range(3):  # prefill and two decode steps alone
            engine.step()
        engine.add_request(Request("long", list(long), long_params))
        mixed = False  # a step that sampled both: the long prompt's last prefill slice and a decode row
        while engine.has_unfinished_requests():
            before = len(engine.update.logits_sink["short"])
            engine.step()
            first_long = len(engine.update.logits_sink.get("long", [])) == 1 and not mixed
            mixed |= first_long and len(engine.update.logits_sink["short"]) == before + 1
        got = [torch.stack(engine.update.logits_sink[name]) for name in ("short", "long")]
    finally:
        engine.update.logits_sink = None
    assert mixed, "the long prefill never shared a step with the decoding sequence"
    _same(got, alone + long_alone, "decode next to a prefill != alone (output 0: the decoding one)")


@pytest.fixture(
    scope="module",
    params=[("float32", c) for c in CODECS] + [("bfloat16", c) for c in BF16_CODECS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def tiny(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    dtype, codec = request.param
    return _engines("tiny-random-llama", codec, dtype=dtype)


def test_warm_equals_cold(tiny: tuple[LLM, LLM]):
    check_warm_equals_cold(*tiny, prompt_len=3 * CHUNK + 7, seed=1)


def test_together_equals_alone(tiny: tuple[LLM, LLM]):
    check_together_equals_alone(*tiny, prompt_len=2 * CHUNK + 11, seed=2)


def test_block_tails_equal_cold(tiny: tuple[LLM, LLM]):
    """A finished request's whole blocks past its last full chunk (a block tail, KVCacheManager.commit_blocks)
    reused by the next question over the same system prompt and by the next turn (its reply's blocks,
    computed by decode steps): bitwise what the cold engine computes."""
    cached, cold = tiny
    system = corpus_token_ids(cached, 2 * CHUNK + 17, seed=41)  # ends 17 tokens into chunk 2
    first = system + corpus_token_ids(cached, 2, seed=42)
    (done,) = cached.generate([first], GREEDY)  # 83 + 7 tokens computed: chunk 2 never fills
    prompts = {
        "next question": system + corpus_token_ids(cached, 5, seed=43),
        "next turn": first + done.token_ids + corpus_token_ids(cached, 3, seed=44),
    }
    hits = {"next question": 2 * CHUNK + 16, "next turn": (len(first) + len(done.token_ids) - 1) // 16 * 16}
    for name, prompt in prompts.items():
        (warm,), warm_logits = generate_with_logits(cached, [prompt], GREEDY)
        _, ref_logits = generate_with_logits(cold, [prompt], GREEDY)
        assert warm.num_cached_tokens == hits[name], name
        _same(warm_logits, ref_logits, f"{name} over a block tail != cold")


def test_decode_next_to_long_prefill(tiny: tuple[LLM, LLM]):
    cached, _ = tiny
    check_decode_next_to_prefill(cached, short_len=20, long_len=600, seed=3)  # budget 512: cut


# kept decoded blocks (kv_decoded_bytes) on the cached engine: 12 blocks a layer (tiny-random-llama,
# fp32: 4 KB a block a layer), fewer than some steps read (those take the dense copy) and than the
# tests write (rows are taken back, least recently read first); and room for every step
KEPT = [("float32", "int4dq", 12 * 4096 * 4), ("float32", "kint3-vturbo3", 12 * 4096 * 4)]
KEPT += [("float32", "turbo3", 4_000_000), ("bfloat16", "kint3dq-vturbo2", 4_000_000)]


@pytest.fixture(scope="module", params=KEPT, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def kept(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    dtype, codec, decoded_bytes = request.param
    return _engines("tiny-random-llama", codec, dtype=dtype, decoded_bytes=decoded_bytes)


def test_kept_decoded_blocks_change_nothing(kept: tuple[LLM, LLM]):
    """Warm == cold, together == alone and decode next to a long prefill, with the cached engine
    reading kept decoded blocks and the cold one decoding every block every step: bitwise."""
    cached, cold = kept
    check_warm_equals_cold(cached, cold, prompt_len=3 * CHUNK + 7, seed=1)
    check_together_equals_alone(cached, cold, prompt_len=2 * CHUNK + 11, seed=2)
    check_decode_next_to_prefill(cached, short_len=20, long_len=600, seed=3)
    stats = cached.engine.stats()
    assert stats.num_decoded_reused > stats.num_decoded_blocks > 0, "the kept blocks were not read"
    assert 0 < stats.decoded_bytes <= cached.config.kv_decoded_bytes
    assert cold.engine.stats().num_decoded_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,codec", [("float32", c) for c in [*CODECS, "mxfp4"]] + [("bfloat16", c) for c in BF16_CODECS]
)
def test_smollm2_real_text(dtype: str, codec: str):
    """The same on SmolLM2 with real text, 128-token chunks and prompts of 300-600 tokens."""
    cached, cold = _engines("smollm2-135m", codec, chunk=128, dtype=dtype)
    check_warm_equals_cold(cached, cold, prompt_len=340, seed=10, chunk=128)
    check_together_equals_alone(cached, cold, prompt_len=300, seed=11)
    check_decode_next_to_prefill(cached, short_len=40, long_len=600, seed=12)

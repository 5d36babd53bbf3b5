"""A fault inside a KV tier's load costs only the chunks it could not fetch: the request computes them and
answers exactly what the cache-off engine answers, on the loader thread and inline (the engine has
nothing else to run, so it loads on its own thread), and no other request in flight is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.integration.helpers import corpus_token_ids

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHUNK = 32
COMMON = dict(model="tiny-random-llama", attention_backend="reference", chunk_size=CHUNK, block_size=16)


def make(tmp: Path | None = None, **overrides) -> LLM:
    tiers = {"kv_disk_dir": str(tmp), "kv_disk_write": "all"} if tmp is not None else {}
    return LLM(**{**COMMON, "max_cache_bytes": 50_000_000, **tiers, **overrides})


def broken_get(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise OSError("injected: the disk tier's read failed")


@pytest.mark.parametrize("alone", [True, False], ids=["inline", "loader-thread"])
def test_a_failing_tier_load_is_recomputed_and_hurts_no_other_request(tmp_path: Path, alone: bool) -> None:
    reference = make(enable_prefix_caching=False)
    prompt = corpus_token_ids(reference, 5 * CHUNK + 9, seed=31)
    other = corpus_token_ids(reference, 3 * CHUNK + 5, seed=32)
    want = [o.token_ids for o in reference.generate([prompt, other], GREEDY)]
    with make(tmp_path) as first:  # closes: its chunks are on disk
        first.generate([prompt], GREEDY)
    second = make(tmp_path)
    assert second.engine.tiers is not None
    disk = second.engine.tiers.tiers.disk
    assert disk is not None and disk.may_hold(second.engine.tiers.tiers.key(_first_hash(second, prompt)))
    disk.get = broken_get  # type: ignore[method-assign]
    prompts = [prompt] if alone else [other, prompt]
    outs = second.generate(prompts, GREEDY)
    got = {tuple(p): o for p, o in zip(prompts, outs, strict=True)}
    assert got[tuple(prompt)].token_ids == want[0]
    assert got[tuple(prompt)].finish_reason.value == "length"
    if not alone:
        assert got[tuple(other)].token_ids == want[1]
    second.engine.check_integrity()
    second.engine.close()


def _first_hash(llm: LLM, prompt: list[int]) -> bytes:
    from kvserve.kvcache.hashing import chunk_prefix_hashes

    return chunk_prefix_hashes(prompt, CHUNK, llm.engine.intake.root(None, None))[0]

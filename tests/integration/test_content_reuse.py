"""Position-independent reuse: content matches, moved KV, selective and CacheBlend repair."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import ReuseOptions
from tests.integration.helpers import corpus_token_ids, generate_with_logits

CHUNK = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def make(model: str = "tiny-random-llama", **kw) -> LLM:
    """Fixed chunking unless asked: piece boundaries (and so the counts below) are then exact. Every
    match is taken, even one whose repair costs more than a prefill (these tests check the repair)."""
    kw.setdefault("pieces", "fixed")
    kw.setdefault("reuse_min_saving", -10.0)
    return LLM(model=model, chunk_size=CHUNK, max_cache_bytes=50_000_000, **kw)


@pytest.fixture(scope="module")
def llms() -> tuple[LLM, LLM]:
    return make(), make(enable_prefix_caching=False)


def test_content_reuse_is_available_and_self_checked(llms: tuple[LLM, LLM]):
    stats = llms[0].stats().content_reuse
    assert stats.available and stats.reason == ""


def _rag_prompt(llm: LLM, docs: list[list[int]], order: list[int], seed: int) -> list[int]:
    prompt = corpus_token_ids(llm, 2 * CHUNK, seed=100 + seed)  # a header that is not cached
    for i in order:
        prompt += docs[i]
    return prompt + corpus_token_ids(llm, 7, seed=200 + seed)


def test_documents_in_new_order_are_reused_and_full_repair_equals_full_prefill():
    llm, cold = make(), make(enable_prefix_caching=False)
    docs = [corpus_token_ids(llm, 3 * CHUNK, seed=10 + i) for i in range(3)]
    for d in docs:
        llm.warm(d)
    prompt = _rag_prompt(llm, docs, [2, 0, 1], seed=1)
    (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
    for opts in (
        ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0),
        ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=10**6),
        ReuseOptions(reuse="any", recompute_strategy="query", recompute_ratio=1.0, recompute_tokens=0),
    ):
        (out,), (logits,) = generate_with_logits(llm, [prompt], GREEDY, opts)
        assert out.num_recomputed_tokens == 9 * CHUNK, opts
        assert out.token_ids == ref.token_ids, opts
        assert (logits - ref_logits).abs().max().item() <= 1e-4, opts
    (plain,) = llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any", recompute_strategy="none"))
    assert plain.num_approx_cached_tokens == 9 * CHUNK and plain.num_recomputed_tokens == 0
    (exact_only,) = llm.generate([prompt], GREEDY)  # the server default stays prefix-only
    assert exact_only.num_approx_cached_tokens == 0 and exact_only.token_ids == ref.token_ids


def test_cacheblend_spends_the_compute_it_reports():
    llm = make()
    docs = [corpus_token_ids(llm, 4 * CHUNK, seed=30 + i) for i in range(2)]
    for d in docs:
        llm.warm(d)
    prompt = _rag_prompt(llm, docs, [1, 0], seed=2)
    n, reused = len(prompt), 8 * CHUNK
    fresh = n - reused
    captured = {}
    repairer = llm.engine.reuse.repairer
    original = repairer.finish

    def spy(seq, repair):
        captured["report"] = report = original(seq, repair)
        return report

    repairer.finish = spy  # type: ignore[method-assign]
    opts = ReuseOptions(
        reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.25, blend_check_layer=1
    )
    (out,) = llm.generate([prompt], GREEDY, reuse=opts)
    report = captured["report"]
    selected = round(0.25 * reused)
    # 4 layers, check layer 1: every row through layers 0-1, then the fresh and selected rows through all
    # (their layers 0-1 again: the same values, to get their hidden states)
    second = fresh + selected
    assert report.token_layers == [n + second, n + second, second, second]
    assert out.num_recomputed_tokens == selected and out.num_approx_cached_tokens == reused - selected
    assert out.compute_fraction == pytest.approx(sum(report.token_layers) / (4 * n))


def test_query_aware_repair_recomputes_what_the_question_attends_to():
    """The question's rows (after the last reused token) run through layers [0, check] first; their
    attention at the check layer over the prompt, measured beside the forward, picks `ratio` of the
    reused tokens past the run starts. The mass equals a softmax of the question's queries against the
    pool's K at that layer (recomputed here with a hook), and the compute is what it reports."""
    llm = make()
    docs = [corpus_token_ids(llm, 4 * CHUNK, seed=50 + i) for i in range(2)]
    for d in docs:
        llm.warm(d)
    prompt = _rag_prompt(llm, docs, [1, 0], seed=3)
    n, reused = len(prompt), 8 * CHUNK
    fresh = n - reused
    question = 7  # _rag_prompt's tail: the rows after the last reused token
    captured: dict = {}
    repairer = llm.engine.reuse.repairer
    original_select, original_finish = repairer.select, repairer.finish

    def spy_select(seq, repair):
        captured["mass"] = repair.query_mass.clone()
        original_select(seq, repair)
        captured["chosen"] = set(repair.passes[-1].positions) - set(repair.fresh)

    def spy_finish(seq, repair):
        captured["report"] = report = original_finish(seq, repair)
        return report

    repairer.select, repairer.finish = spy_select, spy_finish  # type: ignore[method-assign]
    opts = ReuseOptions(
        reuse="any", recompute_strategy="query", recompute_ratio=0.25, recompute_tokens=4, blend_check_layer=1
    )
    (out,) = llm.generate([prompt], GREEDY, reuse=opts)
    mass, chosen, report = captured["mass"], captured["chosen"], captured["report"]
    # every probed row's softmax sums to 1 per head over positions it can see
    heads = llm.engine.model.config.num_attention_heads
    assert mass.sum().item() == pytest.approx(question * heads, rel=1e-4)
    assert mass.shape == (n,)
    # two runs (each document whole): their first 4 tokens, then 25 % of the other reused tokens by mass
    starts = {2 * CHUNK + i for i in range(4)} | {6 * CHUNK + i for i in range(4)}
    others = [p for p in range(2 * CHUNK, 10 * CHUNK) if p not in starts]
    keep = round(0.25 * len(others))
    ranked = sorted(others, key=lambda p: -mass[p].item())
    assert chosen == starts | set(ranked[:keep])
    assert min(mass[p].item() for p in ranked[:keep]) >= max(mass[p].item() for p in ranked[keep:])
    # fresh rows through layers 0-1 first, then fresh + chosen through all 4 layers
    second = fresh + len(chosen)
    assert report.token_layers == [fresh + second, fresh + second, second, second]
    assert out.num_recomputed_tokens == len(chosen) and out.num_approx_cached_tokens == reused - len(chosen)
    assert out.compute_fraction == pytest.approx(sum(report.token_layers) / (4 * n))


def test_attention_probe_equals_a_softmax_over_the_pool():
    """AttentionProbe.observe against the attention weights written out for one layer's K."""
    import torch

    from kvserve.kvcache.quantized_storage import create_layer_kv
    from kvserve.reuse.probe import AttentionProbe

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs, n = 4, 2, 16, 8, 21
    kv = create_layer_kv("auto", 4, bs, kv_heads, d, torch.float32)
    k = torch.randn(n, kv_heads, d, generator=gen)
    slots = torch.randperm(32, generator=gen)[:n]
    kv.write(slots, k, torch.randn(n, kv_heads, d, generator=gen))
    query = torch.randn(10, heads, d, generator=gen)  # a step of 10 rows; rows 6-8 are probed
    positions = torch.tensor([14, 17, 20])
    probe = AttentionProbe(1, [1, 2, 3], positions, slots, torch.zeros(n), first_row=5)
    probe.observe(query, kv, 0.25)
    expect = torch.zeros(n)
    for r, p in zip(range(6, 9), positions.tolist(), strict=True):
        for h in range(heads):
            logits = (k[: p + 1, h // 2] @ query[r, h]) * 0.25
            expect[: p + 1] += torch.softmax(logits.double(), 0).float()
    assert torch.allclose(probe.mass, expect, atol=1e-5)


def test_selective_repairs_only_run_starts_and_registers_only_exact_chunks():
    llm = make()
    docs = [corpus_token_ids(llm, 3 * CHUNK, seed=40 + i) for i in range(2)]
    for d in docs:
        llm.warm(d)
    prompt = _rag_prompt(llm, docs, [1, 0], seed=3)
    chunks_before = len(llm.engine.store)
    opts = ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=5)
    (out,) = llm.generate([prompt], GREEDY, reuse=opts)
    # each document is one run (its pieces are consecutive in the source): 2 runs x 5 tokens
    assert out.num_recomputed_tokens == 10 and out.num_approx_cached_tokens == 6 * CHUNK - 10
    # only the 2 header chunks before the first reused piece hold exact KV and get registered
    assert len(llm.engine.store) == chunks_before + 2
    llm.engine.check_integrity()


def test_content_defined_chunking_finds_documents_at_any_offset():
    fixed, content = make(pieces="fixed"), make(pieces="content", piece_min_tokens=8)
    hits = {}
    for name, llm in (("fixed", fixed), ("content", content)):
        doc = corpus_token_ids(llm, 300, seed=50)
        llm.warm(doc)
        prompt = corpus_token_ids(llm, 45, seed=51) + doc + corpus_token_ids(llm, 5, seed=52)
        (out,) = llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any", recompute_strategy="none"))
        hits[name] = out.num_approx_cached_tokens
        llm.engine.check_integrity()
    assert hits["fixed"] == 0 and hits["content"] >= 150, hits


def test_cache_salt_isolates_content_matches():
    llm = make()
    doc = corpus_token_ids(llm, 3 * CHUNK, seed=60)
    llm.warm(doc, cache_salt="a")
    prompt = corpus_token_ids(llm, CHUNK, seed=61) + doc + [5, 6, 7]
    opts = ReuseOptions(reuse="any", recompute_strategy="none")
    (other,) = llm.generate([prompt], GREEDY, cache_salt="b", reuse=opts)
    (same,) = llm.generate([prompt], GREEDY, cache_salt="a", reuse=opts)
    assert other.num_approx_cached_tokens == 0 and same.num_approx_cached_tokens == 3 * CHUNK


def test_full_repair_without_an_exact_prefix_equals_full_prefill():
    """Every row at every position (the causal fast path of PositionalBackend) stays exact."""
    llm, cold = make(pieces="content", piece_min_tokens=8), make(enable_prefix_caching=False)
    doc = corpus_token_ids(llm, 2 * CHUNK, seed=70)
    llm.warm(doc)
    prompt = corpus_token_ids(llm, 20, seed=71) + doc + [9, 8, 7]  # header shorter than a chunk
    (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
    (out,), (logits,) = generate_with_logits(
        llm, [prompt], GREEDY, ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
    )
    assert out.num_exact_cached_tokens == 0 and out.num_recomputed_tokens > 0
    assert out.token_ids == ref.token_ids and (logits - ref_logits).abs().max().item() <= 1e-4


def test_line_pieces_reuse_documents_on_their_own_lines_whole():
    """--pieces lines: documents that each start on a new line are reused whole in a new order, where
    content-defined pieces lose the pieces across their edges; with every reused token recomputed the
    answer equals full prefill's."""
    words = "river city code mascot founded color north market bridge harbor council".split()
    rng = random.Random(7)
    docs = [
        f"Document {i}: " + " ".join(rng.choice(words) for _ in range(60 + 7 * i)) + ".\n" for i in range(3)
    ]
    reused = {}
    for pieces in ("content", "lines"):
        llm = LLM(
            model="tiny-random-llama", pieces=pieces, reuse_min_saving=-10.0, max_cache_bytes=50_000_000
        )
        encode = llm.tokenizer.encode
        doc_ids = [encode(d) for d in docs]
        llm.warm(encode("You answer questions.\n") + doc_ids[0] + doc_ids[1] + doc_ids[2])
        prompt = encode("Read these.\n") + doc_ids[2] + doc_ids[0] + doc_ids[1] + encode("Which city?\n")
        (plain,) = llm.generate([prompt], GREEDY, reuse=ReuseOptions(reuse="any", recompute_strategy="none"))
        reused[pieces] = plain.num_approx_cached_tokens
        if pieces == "lines":
            assert reused["lines"] == sum(len(d) for d in doc_ids)
            cold = LLM(model="tiny-random-llama", enable_prefix_caching=False, max_cache_bytes=50_000_000)
            (ref,), (ref_logits,) = generate_with_logits(cold, [prompt], GREEDY)
            full = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
            (out,), (logits,) = generate_with_logits(llm, [prompt], GREEDY, full)
            assert out.num_recomputed_tokens == reused["lines"] and out.token_ids == ref.token_ids
            assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert reused["content"] < reused["lines"], reused


def test_a_warmed_document_stays_the_source_over_copies_in_later_prompts():
    """The index keeps a document's warmed copy (computed after nothing but what was warmed) over a
    copy a later prompt computed inside other documents: repairs from warmed KV kept more answers on
    real text (docs/blend.md). Without a warmed copy the newest wins."""
    llm = make()
    doc = corpus_token_ids(llm, 3 * CHUNK, seed=80)
    other = corpus_token_ids(llm, 3 * CHUNK, seed=81)
    index, exact = llm.engine.reuse.matcher.index, ReuseOptions(reuse="any")  # auto: served exactly, indexed
    llm.warm(doc)
    sources = []
    for seed in (82, 83):  # the document inside other prompts, after other headers
        prompt = corpus_token_ids(llm, 2 * CHUNK, seed=seed) + doc + other + [4, 5, 6]
        (out,) = llm.generate([prompt], GREEDY, reuse=exact)
        assert out.num_approx_cached_tokens == 0
        # the other document's pieces point into the newest prompt
        other_pieces = [p for p in index._pieces.values() if p.start_pos >= 5 * CHUNK]
        assert len(other_pieces) == 3 and len({p.source_id for p in other_pieces}) == 1
        sources.append(other_pieces[0].source_id)
    assert sources[0] != sources[1]
    # the warmed copy of each of the document's pieces survived both prompts
    assert sorted(p.start_pos for p in index._pieces.values() if p.warmed) == [0, CHUNK, 2 * CHUNK]
    llm.engine.check_integrity()


def test_line_ends_are_found_at_the_first_cut_or_at_start_up_under_reuse_any():
    """Finding the line ends decodes every token: a server that cuts no prompt skips it, one whose
    requests are all cut (--reuse any) pays it at start-up, not in its first request's TTFT."""
    prefix = LLM(model="tiny-random-llama", pieces="lines", max_cache_bytes=50_000_000)
    assert "cutter" not in vars(prefix.engine.reuse.matcher)
    prefix.generate([[5, 6, 7, 8]], GREEDY)  # served by prefix: nothing cut
    assert "cutter" not in vars(prefix.engine.reuse.matcher)
    prefix.warm(corpus_token_ids(prefix, 2 * CHUNK, seed=90))  # a warm is cut for content matches
    assert vars(prefix.engine.reuse.matcher)["cutter"].line_ends
    anywhere = LLM(model="tiny-random-llama", pieces="lines", reuse="any", max_cache_bytes=50_000_000)
    assert vars(anywhere.engine.reuse.matcher)["cutter"].line_ends

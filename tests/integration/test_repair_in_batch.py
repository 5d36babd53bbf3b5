"""Content-reuse repair inside ordinary steps, cost-aware plans and the online audit (issue 13).

A repair runs as pieces of the packed batch beside other sequences' rows, each row at its own
position, so neither the cut of the repair into pieces nor the rows around it may change a result.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache.stats import num_evictable_blocks
from kvserve.request import Request, ReuseOptions
from kvserve.reuse.audit import first_token_kl
from kvserve.scheduler.batch import ScheduledBatch
from kvserve.stat_table import STATS
from tests.integration.helpers import corpus_token_ids, generate_with_logits

CHUNK = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
SELECTIVE = ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=5)
BLEND = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.3, blend_check_layer=1)
NONE = ReuseOptions(reuse="any", recompute_strategy="none")


def make(**kw) -> LLM:
    kw.setdefault("pieces", "fixed")
    kw.setdefault("reuse_min_saving", -10.0)  # take every match unless a test checks the choice
    kw.setdefault("max_cache_bytes", 50_000_000)
    return LLM(model="tiny-random-llama", chunk_size=CHUNK, **kw)


def rag_prompt(llm: LLM, docs: list[list[int]], order: list[int], seed: int) -> list[int]:
    prompt = corpus_token_ids(llm, 2 * CHUNK, seed=100 + seed)
    for i in order:
        prompt += docs[i]
    return prompt + corpus_token_ids(llm, 7, seed=200 + seed)


def warmed(llm: LLM, num_docs: int = 3, length: int = 4 * CHUNK) -> list[list[int]]:
    docs = [corpus_token_ids(llm, length, seed=10 + i) for i in range(num_docs)]
    for d in docs:
        llm.warm(d)
    return docs


def record_batches(llm: LLM) -> list[list[tuple[str, bool, int]]]:
    """Spy on the model runner: per step, (request id, is a repair slice, rows) of each item."""
    steps: list[list[tuple[str, bool, int]]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(batch: ScheduledBatch, inputs=None):  # type: ignore[no-untyped-def]
        steps.append([(i.seq.request_id, i.positions is not None, i.num_new_tokens) for i in batch.items])
        return execute(batch, inputs)

    runner.execute = spy  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("opts", [SELECTIVE, BLEND], ids=["selective", "cacheblend"])
def test_a_repair_cut_into_small_pieces_equals_one_piece(opts: ReuseOptions):
    whole, pieces = make(max_num_batched_tokens=4096), make(max_num_batched_tokens=48)
    results = []
    for llm in (whole, pieces):
        docs = warmed(llm)
        steps = record_batches(llm)
        (out,), (logits,) = generate_with_logits(
            llm, [rag_prompt(llm, docs, [2, 0, 1], seed=1)], GREEDY, opts
        )
        results.append((out, logits, sum(any(r for _, r, _ in s) for s in steps)))
    (out_a, logits_a, repair_steps_a), (out_b, logits_b, repair_steps_b) = results
    assert out_a.num_approx_cached_tokens > 0 and out_a.num_recomputed_tokens > 0
    assert repair_steps_b > repair_steps_a  # the small budget cut it into more steps
    assert out_a.token_ids == out_b.token_ids and torch.equal(logits_a, logits_b)
    assert out_a.compute_fraction == out_b.compute_fraction


def test_repair_rows_share_steps_with_decode_rows_and_change_neither():
    llm = make(max_num_batched_tokens=64)
    docs = warmed(llm)
    chat = corpus_token_ids(llm, 40, seed=5)
    rag = rag_prompt(llm, docs, [1, 2, 0], seed=2)
    long_decode = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (chat_ref,), (chat_logits,) = generate_with_logits(llm, [chat], long_decode)
    (rag_ref,), (rag_logits,) = generate_with_logits(llm, [rag], GREEDY, BLEND)
    engine = llm.engine
    engine.update.logits_sink = {}
    engine.check_integrity_each_step = True
    steps = record_batches(llm)
    engine.add_request(Request("chat", chat, long_decode))
    for _ in range(3):
        engine.step()  # "chat" is decoding now
    engine.add_request(Request("rag", rag, GREEDY, reuse=BLEND))
    done = {}
    while len(done) < 2:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    mixed = [s for s in steps if {("chat", False), ("rag", True)} <= {(rid, rep) for rid, rep, _ in s}]
    assert len(mixed) >= 2, "repair slices ran beside decode rows"
    assert done["chat"].token_ids == chat_ref.token_ids
    assert torch.equal(torch.stack(engine.update.logits_sink["chat"]), chat_logits)
    assert done["rag"].token_ids == rag_ref.token_ids
    assert torch.equal(torch.stack(engine.update.logits_sink["rag"]), rag_logits)


def test_a_match_is_taken_only_when_it_saves_enough():
    llm = make(reuse_min_saving=0.1)
    docs = warmed(llm)
    prompt = rag_prompt(llm, docs, [2, 0, 1], seed=3)
    (cheap,) = llm.generate([prompt], GREEDY, reuse=NONE)
    assert cheap.reuse_plan == "taken" and cheap.estimated_saving > 0.1
    assert cheap.num_approx_cached_tokens == 12 * CHUNK
    full = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)
    (costly,) = llm.generate([prompt], GREEDY, reuse=full)
    assert costly.reuse_plan == "declined: saves too little" and costly.estimated_saving < 0.1
    assert costly.num_approx_cached_tokens == 0 and costly.num_recomputed_tokens == 0
    (exact,) = llm.generate([prompt], GREEDY)
    assert costly.token_ids == exact.token_ids
    plans = llm.stats().content_reuse.plans
    assert plans == {"taken": 1, "declined: saves too little": 1}
    llm.engine.check_integrity()


def test_a_plan_pays_the_steps_of_its_passes():
    """A repair whose second pass waits on its first takes two steps where the exact prefill takes one:
    where a step's fixed part is most of its time (here priced at 1 s, rows nearly free), a two-pass
    plan costs twice the exact prefill and is declined; a one-pass plan computing fewer rows is taken."""
    llm = make(reuse_min_saving=0.0)
    docs = warmed(llm)
    llm.engine.cost.weights = [1.0, 1e-9, 1e-12, 1e-12]
    llm.engine.cost.observe = lambda work, seconds: None  # type: ignore[method-assign]
    prompt = rag_prompt(llm, docs, [2, 0, 1], seed=30)
    query = ReuseOptions(reuse="any", recompute_strategy="query", recompute_tokens=4, recompute_ratio=0.3)
    (two,) = llm.generate([prompt], GREEDY, reuse=query)
    assert two.reuse_plan == "declined: saves too little" and two.estimated_saving == pytest.approx(
        -1.0, abs=1e-3
    )
    (one,) = llm.generate([rag_prompt(llm, docs, [1, 2, 0], seed=31)], GREEDY, reuse=NONE)
    assert one.reuse_plan == "taken" and 0 < one.estimated_saving < 1e-3


def test_the_cost_model_fits_measured_step_times():
    from kvserve.reuse.cost import CostModel, Work

    model = CostModel(num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, inter=128)
    true = [2e-3, 3e-6, 2e-9, 1e-7]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = int(torch.randint(1, 500, (1,), generator=gen))
        work = Work()
        start = int(torch.randint(0, 2000, (1,), generator=gen))
        work.add_span(start, start + rows, 4)  # a prefill slice
        work.add_rows(float(700 * 3), 3, 4)  # and 3 decode rows around position 700
        work.moved = float(torch.randint(0, 3, (1,), generator=gen)) * 4000
        seconds = sum(w * x for w, x in zip(true, work.features(), strict=True))
        model.observe(work, seconds)
    probe = Work(linear=4000, attend=4e6, moved=8000)
    want = sum(w * x for w, x in zip(true, probe.features(), strict=True))
    assert model.seconds(probe) == pytest.approx(want, rel=0.05)


def test_audit_measures_the_served_kl_and_the_guard_stops_a_bad_document():
    llm, cold = make(audit_rate=0.0, audit_max_kl=1e-9), make(enable_prefix_caching=False)
    docs = warmed(llm)
    prompt = rag_prompt(llm, docs, [2, 0, 1], seed=4)
    audited = ReuseOptions(reuse="any", recompute_strategy="none", audit=True)
    (served,), (served_logits,) = generate_with_logits(llm, [prompt], GREEDY, audited)
    (_,), (full_logits,) = generate_with_logits(cold, [prompt], GREEDY)
    engine = llm.engine
    assert len(engine.reuse.auditor.pending) == 1 and not engine.reuse.auditor.results
    engine.run_background()  # idle now: the audit's full recompute runs, fed the served tokens
    (result,) = engine.reuse.auditor.results
    kl = result.first_kl
    assert result.request_id == served.request_id and result.strategy == "none"
    assert kl == pytest.approx(first_token_kl(full_logits[0], served_logits[0]), rel=1e-5, abs=1e-9)
    assert result.top1 == (int(full_logits[0].argmax()) == int(served_logits[0].argmax()))
    # every served token against the full prefill's distribution at its position (teacher-forced)
    kls, agree = [], []
    for j, token in enumerate(served.token_ids):
        (_,), (full_j,) = generate_with_logits(cold, [prompt + served.token_ids[:j]], ONE)
        kls.append(first_token_kl(full_j[0], served_logits[j]))
        agree.append(int(full_j[0].argmax()) == token)
    assert result.num_tokens == len(served.token_ids) == 6
    assert result.mean_kl == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-8)
    assert result.agreement == sum(agree) / len(agree)
    stats = llm.stats().content_reuse
    audit = stats.audit["none"]
    assert audit.num_audited == 1 and audit.kl_max == pytest.approx(kl)
    assert audit.mean_kl_max == pytest.approx(result.mean_kl) and audit.greedy_agreement == result.agreement
    assert kl > 1e-9 and stats.num_guard_fired == 1 and stats.num_guarded_documents == 12
    # the audit's recompute cached this prompt exactly: the same documents after another header
    (again,) = llm.generate([rag_prompt(llm, docs, [0, 1, 2], seed=8)], GREEDY, reuse=NONE)
    assert again.reuse_plan == "declined: audit guard" and again.num_approx_cached_tokens == 0
    assert llm.stats().content_reuse.num_guard_skips == 12
    engine.check_integrity()


def test_the_audit_takes_the_first_audit_tokens_and_starts_before_the_request_ends():
    llm = make(audit_rate=0.0, audit_tokens=3)
    docs = warmed(llm)
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    audited = ReuseOptions(reuse="any", recompute_strategy="none", audit=True)
    engine.add_request(Request("long", rag_prompt(llm, docs, [1, 2, 0], seed=5), params, reuse=audited))
    while not engine.reuse.auditor.pending:  # submitted at the third token, while the request still decodes
        engine.step()
    assert "long" in engine._records and len(engine._records["long"].seq.output_token_ids) == 3
    while engine.has_unfinished_requests():
        engine.step()
    engine.run_background()
    (result,) = engine.reuse.auditor.results
    assert result.num_tokens == 3 and not engine.reuse.auditor.tracing
    engine.check_integrity()


def presets_file(tmp_path, verified: bool, pieces: str = "fixed", agreement: float = 0.5) -> str:
    """A verified-presets file as `bench_reuse_quality.py --verify` writes it, for tiny-random-llama."""
    entry = {
        "verified": verified,
        "preset": {"name": "none", "recompute_strategy": "none"},
        "pieces": pieces,
        "audit_agreement": agreement,
        "source": "a test's file",
        "data": ["none"],
    }
    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"models": {"tiny-random-llama": entry}}))
    return str(path)


def counted_lookups(index) -> list[bytes]:
    """The content keys `index` looks up from now on (the matches whose KV a plan would move)."""
    keys: list[bytes] = []
    lookup = index.lookup

    def counted(key: bytes):
        keys.append(key)
        return lookup(key)

    index.lookup = counted
    return keys


def test_auto_serves_matches_exactly_on_a_model_no_repair_is_verified_on(tmp_path):
    """--reuse any with the default strategy (auto): no preset is verified on this model (the package's
    file has none; a file listing it as measured and missed is the same), so a prompt with content
    matches is served exactly and the plan says why, without looking the matched pieces' KV up (a
    declined plan costs nothing but a set lookup per piece); a request that names a strategy opts into
    it and usage says so."""
    for presets in ("", presets_file(tmp_path, verified=False)):
        llm, cold = make(reuse="any", verified_presets=presets), make(enable_prefix_caching=False)
        assert llm.engine.config.recompute_strategy == "auto" and llm.engine.reuse.matcher.auto.preset is None
        docs = warmed(llm)
        looked_up = counted_lookups(llm.engine.reuse.matcher.index)
        prompt = rag_prompt(llm, docs, [2, 0, 1], seed=12)
        (ref,) = cold.generate([prompt], GREEDY)
        (out,) = llm.generate([prompt], GREEDY)
        assert out.reuse_plan == "declined: no repair verified on this model" and out.reuse_preset is None
        assert out.num_approx_cached_tokens == 0 and out.token_ids == ref.token_ids and not looked_up
        (named,) = llm.generate([rag_prompt(llm, docs, [1, 2, 0], seed=13)], GREEDY, reuse=NONE)
        assert named.reuse_plan == "taken" and named.num_approx_cached_tokens > 0 and looked_up
        assert named.reuse_preset == "named by the request"
        assert llm.stats().content_reuse.plans["declined: no repair verified on this model"] == 1


def test_auto_repairs_with_the_verified_preset_of_the_file_and_names_it(tmp_path):
    trusted = make(reuse="any", verified_presets=presets_file(tmp_path, verified=True))
    docs = warmed(trusted)
    (out,) = trusted.generate([rag_prompt(trusted, docs, [2, 0, 1], seed=12)], GREEDY)
    assert out.reuse_plan == "taken" and out.num_approx_cached_tokens > 0
    assert out.reuse_preset == "auto: none, verified on tiny-random-llama (a test's file; data none)"
    auto = trusted.stats().content_reuse.auto
    assert auto["preset"] == "none" and auto["fell_back"] is None
    # measured with other pieces: auto does not apply it to this server's cuts
    other = make(reuse="any", verified_presets=presets_file(tmp_path, verified=True, pieces="lines"))
    docs = warmed(other)
    (out,) = other.generate([rag_prompt(other, docs, [2, 0, 1], seed=12)], GREEDY)
    assert out.reuse_plan.startswith("declined: the repair verified on this model was measured with other")


def test_auto_falls_back_to_exact_when_its_audits_agree_less_than_the_verification(tmp_path, monkeypatch):
    """The watch judges only auto-repaired prompts' audits; once they are clearly below the
    verification's agreement, auto serves exactly, says why, and shows it in the stats."""
    from kvserve.reuse import verified

    monkeypatch.setattr(verified, "WATCH_MIN_AUDITS", 3)
    llm = make(reuse="any", audit_rate=1.0, verified_presets=presets_file(tmp_path, True, agreement=1.0))
    cold = make(enable_prefix_caching=False)
    docs = warmed(llm)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    agreements = []
    for seed in range(40):  # the audits of this random model scatter (0.1-1.0): the bound needs a few
        prompt = rag_prompt(llm, docs, [seed % 3, (seed + 1) % 3, (seed + 2) % 3], seed=20 + seed)
        (out,) = llm.generate([prompt], params)
        llm.engine.run_background()
        agreements.append(llm.engine.reuse.auditor.results[-1].agreement)
        if llm.stats().content_reuse.auto["fell_back"]:
            break
    assert min(agreements) < 1.0, "the random model's repair kept every token: nothing to fall back from"
    auto = llm.stats().content_reuse.auto
    assert auto["fell_back"] and auto["num_audits"] == len(agreements) >= 3
    assert llm.engine.reuse.auditor.results[-1].auto
    prompt = rag_prompt(llm, docs, [1, 0, 2], seed=40)
    (after,), (ref,) = llm.generate([prompt], GREEDY), cold.generate([prompt], GREEDY)
    assert (
        after.reuse_plan
        == "declined: auto fell back to exact serving (its audits fell below the verification's)"
    )
    assert after.token_ids == ref.token_ids and after.num_approx_cached_tokens == 0
    (gauge,) = [s for s in STATS if s.prom == "kvserve:reuse_auto_fell_back"]
    assert gauge.value(llm.stats()) == 1.0


def test_audits_wait_while_requests_run_and_never_reach_a_client():
    llm = make(audit_rate=1.0)
    docs = warmed(llm)
    engine = llm.engine
    steps = record_batches(llm)
    prompt = rag_prompt(llm, docs, [0, 1], seed=6)
    chat = corpus_token_ids(llm, 30, seed=7)
    engine.add_request(Request("rag", prompt, SamplingParams(max_tokens=2, temperature=0), reuse=NONE))
    engine.add_request(Request("chat", chat, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"rag", "chat"} and len(engine.reuse.auditor.results) == 1
    for step in steps:
        ids = {rid for rid, _, _ in step}
        assert not ({"rag", "chat"} & ids and any(i.startswith("audit:") for i in ids))
    engine.check_integrity()


def test_a_decode_slowdown_limit_keeps_prefill_pieces_small_beside_decodes_and_changes_nothing():
    free, limited = make(), make(decode_slowdown_limit=1.5)
    outs = []
    for llm in (free, limited):
        docs = warmed(llm)
        engine = llm.engine
        # fixed prices (not fitted to this machine's step times): 1 ms a step, 0.1 ms a token-layer
        engine.cost.weights = [1e-3, 1e-4, 1e-8, 1e-7]
        engine.cost.observe = lambda work, seconds: None  # type: ignore[method-assign]
        engine.update.logits_sink = {}
        steps = record_batches(llm)
        long_decode = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        for i in range(2):
            engine.add_request(Request(f"chat{i}", corpus_token_ids(llm, 20, seed=i), long_decode))
        for _ in range(3):
            engine.step()
        engine.add_request(Request("rag", rag_prompt(llm, docs, [2, 1, 0], seed=9), GREEDY, reuse=BLEND))
        engine.add_request(Request("long", corpus_token_ids(llm, 300, seed=11), GREEDY))
        done = {}
        while len(done) < 4:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        beside = [
            sum(n for rid, _, n in s if rid in ("rag", "long"))
            for s in steps
            if any(rid.startswith("chat") for rid, _, _ in s)
        ]
        outs.append(({rid: o.token_ids for rid, o in done.items()}, engine.update.logits_sink, max(beside)))
        assert engine.scheduler.granularity == 1  # dense KV: pieces may end at any token
    (free_tokens, free_logits, free_max), (lim_tokens, lim_logits, lim_max) = outs
    # 2 decode rows cost 1 ms + 8 token-layers = 1.8 ms; half of that buys 2 rows of 4 token-layers
    assert free_max > 100 and lim_max == 2, (free_max, lim_max)
    assert free_tokens == lim_tokens
    for rid in free_logits:
        assert torch.equal(torch.stack(free_logits[rid]), torch.stack(lim_logits[rid])), rid


@pytest.mark.timeout(120)
def test_a_request_never_waits_on_an_audit_computing_its_chunks():
    """Issue 32: B (documents reordered) is served from a content hit and its audit is queued; the
    audit, admitted in an idle step, holds B's chunks in flight; B again then waited on them while
    the audit waited for an idle step: a livelock. Background work never holds chunks in flight."""
    llm = make(audit_rate=1.0)
    engine = llm.engine
    docs = warmed(llm, num_docs=2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate([rag_prompt(llm, docs, [0, 1], seed=1)], params)
    prompt_b = rag_prompt(llm, docs, [1, 0], seed=1)
    (b,) = llm.generate([prompt_b], params, reuse=NONE)
    assert b.num_approx_cached_tokens > 0 and engine.reuse.auditor.pending
    engine.step()  # idle: the audit is admitted and computes its first piece
    assert any(s.request.background for s in engine.scheduler.running)
    engine.add_request(Request("b-again", prompt_b, params, reuse=NONE))
    for _ in range(200):
        if any(o.request_id == "b-again" and o.finished for o in engine.step()):
            break
    else:
        pytest.fail("the repeat never finished: it waits on the audit, which waits for an idle step")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.reuse.auditor.results) >= 1
    engine.check_integrity()


@pytest.mark.timeout(120)
def test_a_request_id_reused_while_its_audit_waits_audits_both():
    """Issue 32.7: the audit's id was `audit:<request id>`, so a reused request id overwrote the pending
    audit; the first audit to finish then took the second's job and the second's KeyError failed the
    whole step."""
    llm = make(audit_rate=1.0)
    engine = llm.engine
    docs = warmed(llm, num_docs=2)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for seed in (1, 2):  # the same id twice, the first's audit still pending when the second is served
        engine.add_request(Request("same-id", rag_prompt(llm, docs, [1, 0], seed=seed), params, reuse=NONE))
        while "same-id" in engine._records:
            engine.step()
    assert len(engine.reuse.auditor.pending) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.request_id for r in engine.reuse.auditor.results] == ["same-id", "same-id"]
    assert engine.reuse.auditor.num_dropped == 0
    engine.check_integrity()


def test_an_audit_waiting_past_the_request_timeout_still_completes(monkeypatch):
    """Audits run only while the engine is idle; they were aborted as timed out once older than
    request_timeout_s, so a run busy for longer than that (a benchmark, a loaded server) lost every
    audit queued before the first idle moment, counted as dropped."""
    llm = make(audit_rate=0.0, request_timeout_s=30.0)
    engine = llm.engine
    docs = warmed(llm)
    audited = ReuseOptions(reuse="any", recompute_strategy="none", audit=True)
    (served,) = llm.generate([rag_prompt(llm, docs, [2, 0, 1], seed=4)], GREEDY, reuse=audited)
    assert len(engine.reuse.auditor.pending) == 1
    start = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: start + 60.0)  # the engine was busy for a minute
    (again,) = llm.generate([rag_prompt(llm, docs, [1, 2, 0], seed=5)], GREEDY, reuse=NONE)
    engine.run_background()
    assert [r.request_id for r in engine.reuse.auditor.results] == [served.request_id]
    assert engine.reuse.auditor.num_dropped == 0
    engine.check_integrity()


PARAMS3 = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _audit_running(llm: LLM) -> None:
    """A reordered prompt served from content hits, its audit admitted in the idle step after it."""
    docs = warmed(llm, num_docs=2)
    llm.generate([rag_prompt(llm, docs, [0, 1], seed=1)], PARAMS3)
    llm.generate([rag_prompt(llm, docs, [1, 0], seed=1)], PARAMS3, reuse=NONE)
    llm.engine.step()  # idle: the audit is admitted and computes its first piece
    (audit,) = llm.engine.scheduler.running
    assert audit.request.background and llm.engine.kv.block_ids(audit.request_id)


def _serve_then_audit(llm: LLM, prompt: list[int], what: str) -> None:
    """`prompt` finishes while the audit waits, then the audit completes."""
    engine = llm.engine
    engine.add_request(Request("next", prompt, PARAMS3, reuse=NONE))
    for _ in range(100):
        if any(o.request_id == "next" and o.finished for o in engine.step()):
            break
    else:
        pytest.fail(f"the request waited forever for {what} of an audit that waits for an idle step")
    engine.run_background()
    assert len(engine.reuse.auditor.results) == 1 and engine.reuse.auditor.num_dropped == 0
    engine.check_integrity()


def test_a_request_preempts_an_audit_holding_the_blocks_it_needs():
    """An audit admitted in an idle step keeps its blocks while requests run (it steps only when the
    engine is idle); a request that needed them waited for them, the engine never went idle, and
    the server hung (the CI dashboard test). Requests preempt background work for memory."""
    llm = make(audit_rate=1.0, max_cache_bytes=64 * 16 * 1024)  # a 64-block pool, 16 of them pinned
    _audit_running(llm)
    free = llm.engine.pool.num_free_blocks + num_evictable_blocks(llm.engine.pool, llm.engine.store)
    long = corpus_token_ids(llm, (free + 4) * 16, seed=50)  # needs more than is free or evictable
    _serve_then_audit(llm, long, "the blocks")


def test_a_request_preempts_an_audit_holding_the_last_sequence_slot():
    """The same wait for a sequence slot (--max-num-seqs 1)."""
    llm = make(audit_rate=1.0, max_num_seqs=1)
    _audit_running(llm)
    _serve_then_audit(llm, corpus_token_ids(llm, 40, seed=51), "the slot")

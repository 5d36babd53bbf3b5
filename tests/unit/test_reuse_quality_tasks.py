"""scripts/bench_reuse_quality.py: the task it generates and the scores it computes."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_reuse_quality as rq  # noqa: E402


def test_documents_plant_one_fact_each_about_distinct_entities():
    docs = rq.make_docs(40, random.Random(3))
    assert len({d.name for d in docs}) == 40
    for d in docs:
        fact = rq.FACTS[d.fact][0].format(name=d.name, v=d.value)
        assert d.text.count(fact) == 1 and d.name in d.question
        # no other kind of fact about the entity: its question would have no answer
        others = [f for i, (f, _, _) in enumerate(rq.FACTS) if i != d.fact]
        assert not any(f.split("{v}")[0].format(name=d.name) in d.text for f in others)


def test_real_sources_do_not_depend_on_what_was_imported(tmp_path: Path):
    """sys.path grows with imports (importing kvserve puts setuptools' vendored packages there): the
    sources, and so a seed's documents, must not."""
    before = rq.real_sources()
    info = tmp_path / "planted_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: planted-pkg\nVersion: 1.0\n\n" + "Words. " * 400
    )
    sys.path.append(str(tmp_path))
    try:
        assert rq.real_sources() == before
    finally:
        sys.path.remove(str(tmp_path))
    assert not any("kvserve" in subject for subject, _ in before)


def test_real_documents_are_excerpts_of_real_sources_with_one_planted_fact():
    rng = random.Random(4)
    docs = rq.make_real_docs(60, rng)
    sources = dict(rq.real_sources())
    assert len({d.name for d in docs}) == 60
    assert {d.kind for d in docs} == {"section", "module", "package"}  # the three sources
    for d in docs:
        planted = rq.FACTS[d.fact][0].format(name=d.name, v=d.value)
        planted = planted[0].upper() + planted[1:]
        header, body = d.text.split("\n", 1)
        assert header == f"Document: {d.name}." and body.count(planted) == 1 and d.name in d.question
        rest = body.replace(planted, " ")
        assert d.value.lower() not in rest.lower()  # the planted value is the only one of its kind
        assert 140 <= len(rest.split()) <= 165
        # the rest is the source's own words, in its order (whitespace and markup lines aside)
        words = " ".join(rq._paragraphs(sources[d.name])).split()
        first = rest.split()[:8]
        assert any(words[i : i + 8] == first for i in range(len(words))), d.name


@pytest.mark.parametrize("measure", ["lookup", "multihop", "recall", "freeform"])
def test_prompts_ask_about_their_own_documents_in_new_orders(measure):
    rng = random.Random(5)
    docs = rq.make_docs(30, rng)
    prompts = rq.make_prompts(measure, docs, 60, rng)
    orders = set()
    for p in prompts:
        assert 3 <= len(p.doc_ids) <= 6 and len(set(p.doc_ids)) == len(p.doc_ids)
        chosen = [docs[i] for i in p.doc_ids]
        for answer in p.answers:
            assert any(d.value == answer and d.name in p.question for d in chosen)
        assert len(p.answers) == {"lookup": 1, "multihop": 2, "recall": 1, "freeform": 0}[measure]
        orders.add(tuple(p.doc_ids))
    assert len(orders) == len(prompts)  # no order repeats


def test_every_document_is_seeded_twice_inside_other_documents():
    groups = rq.seeding_groups(30, random.Random(1))
    seen = [i for g in groups for i in g]
    assert sorted(seen) == sorted(list(range(30)) * 2)
    assert all(2 <= len(g) <= 4 for g in groups)


def test_scores():
    assert rq.correct("The code is 4821.", ["4821"]) and not rq.correct("It is 482", ["4821"])
    assert rq.correct("Oslo, and 1990", ["oslo", "1990"]) and not rq.correct("Oslo", ["oslo", "1990"])
    assert rq.rouge_l("a b c d", "a b c d") == 1.0 and rq.rouge_l("a b", "c d") == 0.0
    assert rq.rouge_l("a x b y", "a b") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    lo, hi = rq.wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert rq.wilson(0, 10)[0] == 0.0 and rq.wilson(10, 10)[1] == 1.0
    assert rq.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert rq.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert rq.spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)


def test_codec_results_are_judged_against_the_first_codec(capsys):
    """--codecs (issue 38): quality relative to the reference codec's, capacity from bytes per token."""
    rows = {
        "bf16": {"ttft": [1.0, 1.2], "decode_tps": [20.0, 22.0], "compute": [1.0] * 2, "reused": [0.0] * 2,
                 "correct": [1.0, 1.0]},
        "turbo3": {"ttft": [0.9, 1.1], "decode_tps": [6.0, 8.0], "compute": [1.0] * 2, "reused": [0.0] * 2,
                   "correct": [1.0, 0.0]},
    }  # fmt: skip
    result = {
        "rows": rows,
        "reference": "bf16",
        "bytes_per_token": {"bf16": 23040.0, "turbo3": 4680.0},
        "docs": 6,
        "avg_prompt_tokens": 600.0,
    }
    table = rq.summarise("lookup", result)
    assert table["turbo3"]["x_full"] == pytest.approx(0.5) and table["bf16"]["x_full"] == 1.0
    assert table["turbo3"]["decode_tps"] == pytest.approx(7.0)
    assert table["turbo3"]["ttft_x_full"] == pytest.approx(1.0 / 1.1)
    rq.print_table("lookup", result, table)
    assert "| turbo3 | 4,680 | 4.92 | 0.500" in capsys.readouterr().out


def test_a_codec_run_records_what_the_server_chooses_by(tmp_path, monkeypatch):
    """--registry: each codec's accuracy x the reference's, merged per model and measure, is the file
    kvserve/quant/choice.py picks --kv-cache-bits codecs from."""
    from kvserve.quant import choice

    table = {
        "bf16": {"quality": 0.76, "x_full": 1.0, "bytes_per_token": 23040.0},
        "int3": {"quality": 0.47, "x_full": 0.6184, "bytes_per_token": 6120.0},
        "turbo3": {"quality": 0.3, "x_full": 0.3947, "bytes_per_token": 4680.0},
    }
    path = tmp_path / "acc.json"
    args = {"model": "m1", "prompts": 200, "docs": 40, "seed": 0, "codecs": "bf16,int3,turbo3"}
    rq.record_accuracy(str(path), args, "lookup", table, "a CPU", "bfloat16")
    rq.record_accuracy(str(path), {**args, "model": "m2"}, "lookup", {**table, "int3": {**table["int3"], "quality": 0.38, "x_full": 0.5}}, "a CPU", "bfloat16")  # fmt: skip
    monkeypatch.setattr(choice, "ACCURACY_FILE", path)
    choice._measurements.cache_clear()
    try:
        assert choice.measured_accuracy("int3") == {
            "m1": pytest.approx(0.47 / 0.76),
            "m2": pytest.approx(0.5),
        }
        got = choice.choose_codec(3, 3, 64, 16)
        assert (got.codec, got.meets) == ("int3", False)
        assert "m1: 200 lookup prompts" in choice.measurement_source()
        # int3's K takes one scale and zero per block: measured at 16-token blocks, not at 64; turbo3
        # is per token and the same at any block size
        assert choice.measured_accuracy("int3", 64) == {}
        assert choice.codec_quality("int3", 3, 64, 64, "--kv-cache-dtype int3") is None
        assert choice.measured_accuracy("turbo3", 64) == choice.measured_accuracy("turbo3", 16) != {}
        assert choice.choose_codec(3, 3, 64, 64).codec == "turbo3"
    finally:
        choice._measurements.cache_clear()


def test_a_second_codec_run_on_the_same_prompts_adds_its_codecs(tmp_path):
    """A later run of more codecs (the reference scored the same: the same prompts) merges into the
    entry; a run on other prompts replaces it."""
    ref = {"quality": 0.765, "x_full": 1.0, "bytes_per_token": 23040.0}
    first = {"bf16": ref, "int4": {"quality": 0.8, "x_full": 1.0458, "bytes_per_token": 7560.0}}
    second = {"bf16": ref, "turbo3": {"quality": 0.7, "x_full": 0.915, "bytes_per_token": 4680.0}}
    path = tmp_path / "acc.json"
    args = {"model": "m", "prompts": 200, "docs": 40, "seed": 0, "codecs": "bf16,int4"}
    rq.record_accuracy(str(path), args, "lookup", first, "a CPU", "bfloat16")
    rq.record_accuracy(str(path), {**args, "codecs": "bf16,turbo3"}, "lookup", second, "a CPU", "bfloat16")
    entry = json.loads(path.read_text())["models"]["m"]["lookup"]
    assert entry["x_reference"] == {"bf16": 1.0, "int4": 1.0458, "turbo3": 0.915}
    assert entry["source"].endswith("--codecs bf16,int4,turbo3")
    rq.record_accuracy(str(path), {**args, "seed": 1}, "lookup", second, "a CPU", "bfloat16")
    entry = json.loads(path.read_text())["models"]["m"]["lookup"]
    assert set(entry["accuracy"]) == {"bf16", "turbo3"} and entry["seed"] == 1
    rq.record_accuracy(str(path), {**args, "seed": 1}, "lookup", first, "a CPU", "float32")
    entry = json.loads(path.read_text())["models"]["m"]["lookup"]  # another compute dtype: not merged
    assert set(entry["accuracy"]) == {"bf16", "int4"} and entry["compute_dtype"] == "float32"
    assert entry["block_size"] == 16  # the default
    rq.record_accuracy(str(path), {**args, "seed": 1, "block_size": 64}, "lookup", second, "a CPU", "float32")
    entry = json.loads(path.read_text())["models"]["m"]["lookup"]  # another block size: not merged
    assert set(entry["accuracy"]) == {"bf16", "turbo3"} and entry["block_size"] == 64
    rq.record_accuracy(str(path), {**args, "text": "real"}, "lookup", first, "a CPU", "bfloat16")
    models = json.loads(path.read_text())["models"]["m"]
    assert models["lookup"]["block_size"] == 64  # the real-text family is its own entry
    assert (
        set(models["lookup.real"]["accuracy"]) == {"bf16", "int4"}
        and "--text real" in models["lookup.real"]["source"]
    )


def test_the_pareto_front_keeps_only_codecs_nothing_beats_on_both_bytes_and_accuracy():
    points = [
        (23040, 1.0),
        (12240, 1.02),
        (13320, 0.99),
        (6120, 0.98),
        (7560, 1.04),
        (4680, 0.73),
        (4680, 0.5),
    ]
    assert rq.pareto_front(points) == [(4680, 0.73), (6120, 0.98), (7560, 1.04)]


def _codec_run(model: str, codecs: dict[str, list[float]], reference: str = "bf16") -> dict:
    rows = {
        c: {"correct": v, "ttft": [0.1] * len(v), "compute": [1.0] * len(v), "reused": [0.0] * len(v)}
        for c, v in codecs.items()
    }
    raw = {"rows": rows, "reference": reference, "bytes_per_token": {c: 100.0 for c in codecs}}
    return {
        "model": model,
        "seed": 0,
        "codecs": list(codecs),
        "args": {"json": f"{model}.json"},
        "raw": {"lookup": raw},
    }


def test_merged_codec_runs_are_one_run_of_every_codec_and_refuse_other_prompts():
    ref = [1.0, 1.0, 0.0, 1.0]
    first = _codec_run("m", {"bf16": ref, "int4": [1.0, 0.0, 0.0, 1.0]})
    second = _codec_run("m", {"bf16": ref, "turbo3": [0.0, 0.0, 1.0, 1.0], "int4": [0.0] * 4})
    merged = rq.merge_runs([first, second])
    assert merged["codecs"] == ["bf16", "int4", "turbo3"]
    table = merged["tables"]["lookup"]
    assert table["int4"]["x_full"] == pytest.approx(2 / 3)  # the first run's rows of a codec in both
    assert table["turbo3"]["x_full"] == pytest.approx(2 / 3)
    assert rq.lost_gained(ref, [0.0, 0.0, 1.0, 1.0]) == (2, 1)
    other_prompts = _codec_run("m", {"bf16": [0.0, 1.0, 1.0, 1.0], "fp8": ref})
    with pytest.raises(ValueError, match="reference scored other prompts"):
        rq.merge_runs([first, other_prompts])
    with pytest.raises(ValueError, match="one model"):
        rq.merge_runs([first, _codec_run("m2", {"bf16": ref})])
    fp32 = _codec_run("m", {"bf16": ref, "fp8": ref})
    first["raw"]["lookup"]["compute_dtype"], fp32["raw"]["lookup"]["compute_dtype"] = "bfloat16", "float32"
    with pytest.raises(ValueError, match="computed in float32, the first in bfloat16"):
        rq.merge_runs([first, fp32])  # the same verdicts, other arithmetic: a coincidence, not one run


def _freeform_run(reference_texts: list[str], digest: str | None = None) -> dict:
    n = len(reference_texts)
    one, cell = [1.0] * n, {"ttft": [0.1] * n, "compute": [1.0] * n, "reused": [0.0] * n}
    rows = {c: {"rouge": one, "exact": one, **cell} for c in ("bf16", "int4")}
    raw = {
        "rows": rows,
        "reference": "bf16",
        "bytes_per_token": {"bf16": 100.0, "int4": 30.0},
        "samples": [{"prompt": i, "answers": [], "bf16": t} for i, t in enumerate(reference_texts)],
    }
    if digest is not None:
        raw["reference_digest"] = digest
    return {
        "model": "m",
        "seed": 0,
        "codecs": ["bf16", "int4"],
        "args": {"json": "f.json"},
        "raw": {"freeform": raw},
    }


def test_free_form_runs_merge_only_over_the_same_reference_text():
    """Free form scores each codec against the reference's own text, so the reference always scores 1.0:
    two runs whose references wrote different text (another machine's arithmetic) are refused by their
    kept samples, or by the digest of every reference answer where both runs have one."""
    texts = ["the pump is red", "it opens at nine"]
    assert rq.merge_runs([_freeform_run(texts), _freeform_run(texts)])["codecs"] == ["bf16", "int4"]
    with pytest.raises(ValueError, match="wrote other text"):
        rq.merge_runs([_freeform_run(texts), _freeform_run(["the pump is blue", "it opens at nine"])])
    with pytest.raises(ValueError, match="wrote other text"):  # the samples agree, the digests do not
        rq.merge_runs([_freeform_run(texts, "a" * 64), _freeform_run(texts, "b" * 64)])


def test_free_form_is_read_against_the_int8_kv_floor_of_the_accuracy_file():
    runs = json.loads(rq.ACCURACY_FILE.read_text())["models"]["smollm2-135m"]
    line = rq.int8_floor("smollm2-135m")
    assert f"ROUGE-L {runs['freeform']['accuracy']['int8']:.3f}" in line
    assert f"keeps {runs['lookup']['x_reference']['int8']:.3f}x" in line
    assert rq.int8_floor("no-such-model").startswith("(no int8 KV free-form run on no-such-model")


def test_strategy_names_read_as_request_options():
    assert rq.strategy("full prefill") is None
    opts = rq.strategy("query R=8 0.15 L3 seam=2")
    assert (opts.reuse, opts.recompute_strategy, opts.recompute_tokens, opts.recompute_ratio) == (
        "any",
        "query",
        8,
        0.15,
    )
    assert (opts.blend_check_layer, opts.blend_seam_tokens) == (3, 2)
    assert rq.strategy("cacheblend 0.3").recompute_tokens is None  # unset: the server's
    for bad in ("blend 0.15", "query R=x", "query fast"):
        with pytest.raises(ValueError):
            rq.strategy(bad)
    assert all(rq.strategy(n) is not None for n in rq.STRATEGIES[1:])


def test_a_measure_run_alone_draws_the_prompts_it_draws_beside_the_others():
    assert rq.measure_rng(0, "recall").random() != rq.measure_rng(0, "lookup").random()
    assert rq.measure_rng(0, "recall").random() == random.Random(2).random()  # its place in a full run
    with pytest.raises(ValueError, match="unknown measure"):
        rq.measure_rng(0, "summary")


def test_a_verification_measure_joins_its_family_run_only_when_the_settings_match(tmp_path: Path, capsys):
    """A stopped verification goes on measure by measure (--verify --measures recall): the saved family
    run takes the new measure only when it is the same run (prompts, seed, pieces, candidates ...)."""
    args = {k: 1 for k in rq.SAME_RUN}
    saved = {
        "model": "m",
        "text": "real",
        "args": args,
        "command": "first",
        "tables": {"lookup": {"full prefill": {}, "query R=4 0.15": {}}},
        "raw": {"lookup": {}},
    }
    path = tmp_path / "run_real.json"
    path.write_text(json.dumps(saved))
    new = {"model": "m", "text": "real", "args": dict(args), "command": "second", "tables": {}, "raw": {}}
    joined = rq.earlier_run(str(path), new, ["query R=4 0.15"])
    assert joined is not None and "lookup" in joined["tables"] and joined["commands"] == ["first", "second"]
    assert rq.earlier_run(str(path), new, ["query R=8 0.15"]) is None  # other candidates
    assert rq.earlier_run(str(path), {**new, "args": {**args, "prompts": 2}}, ["query R=4 0.15"]) is None
    assert rq.earlier_run(str(tmp_path / "none.json"), new, ["query R=4 0.15"]) is None

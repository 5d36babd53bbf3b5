"""The step's batch sampler (engine/batch_sampler.py) gives every row what `sample_one` gives it alone,
bitwise in token ids and logprobs, over batches mixing every parameter; a seeded row's tokens do not
depend on its batch-mates; argmax_rows is torch.argmax (ties, NaN, -inf, signed zeros)."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine import batch_sampler
from kvserve.engine.batch_sampler import (
    ARGMAX_BLOCK,
    ARGMAX_BLOCKED_MIN,
    SamplingRow,
    filter_rows,
    process_rows,
    sample_batch,
)
from kvserve.engine.sampler import apply_penalties, filter_logits, plain_greedy, sample_one
from kvserve.kernels import cpu_ext
from kvserve.request import SamplingParams


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    """Both thread counts: with 2, torch splits a long 1-D sum over threads (the suite runs with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.0, 0.3, 0.8, 1.0, 1.7])}
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([1, 2, 7, 50])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.1, 0.5, 0.9, 0.95])
    if rng.random() < 0.3:
        kw["min_p"] = rng.choice([0.01, 0.05, 0.2])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.8, 1.1, 1.3])
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([-0.5, 0.4, 1.0])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([-0.3, 0.2, 0.7])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, -3.5, 2.25, 7.0]) for _ in range(3)}
    if rng.random() < 0.4:
        kw["logprobs"] = rng.choice([0, 1, 5, 20])
    return SamplingParams(**kw)


def _batch(seed: int, n: int, vocab: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    """Logits [n + 2, vocab] (ties from integer values in some rows, an all -inf row) and n rows on
    shuffled logits rows, mixing every parameter and grammar masks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 2, vocab, generator=gen) * 3
    for r in range(0, n + 2, 3):
        logits[r] = torch.randint(-4, 5, (vocab,), generator=gen).float()  # many tied maxima
    logits[n + 1] = float("-inf")
    order = list(range(n + 2))
    rng.shuffle(order)
    rows = []
    for r in order[:n]:
        allowed = None
        if rng.random() < 0.25:
            allowed = torch.rand(vocab, generator=gen) < rng.choice([0.001, 0.3, 0.9])
        rows.append(
            SamplingRow(
                row=r,
                params=_params(rng, vocab),
                prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))],
                output_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))],
                generator=torch.Generator().manual_seed(rng.randrange(2**31)),
                allowed=allowed,
            )
        )
    return logits, rows


def _reference(logits: torch.Tensor, row: SamplingRow, generator: torch.Generator):
    try:
        return sample_one(
            logits[row.row], row.params, row.prompt_token_ids, row.output_token_ids, generator, row.allowed
        )
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a bf16 model's logits as they come
@pytest.mark.parametrize("vocab", [1000, 40000])  # 40000: past the size torch splits a 1-D sum at
def test_every_row_equals_its_own_sample_one_bitwise(vocab: int, dtype: torch.dtype, threads: int):
    for seed in range(12 if vocab == 1000 else 3):
        logits, rows = _batch(seed, n=14, vocab=vocab)
        logits = logits.to(dtype)
        reference_generators = [torch.Generator().set_state(r.generator.get_state()) for r in rows]
        results = sample_batch(logits, rows)
        for row, result, generator in zip(rows, results, reference_generators):
            expected = _reference(logits, row, generator)
            if isinstance(expected, Exception):
                assert isinstance(result, RuntimeError), (seed, row)
                continue
            assert not isinstance(result, Exception), (seed, row, result)
            assert result[0] == expected[0], (seed, row.params)
            assert repr(result[1]) == repr(expected[1]), (seed, row.params)  # repr: exact floats, NaN too
            assert torch.equal(row.generator.get_state(), generator.get_state())


@pytest.mark.parametrize("vocab", [1000, 40000, 40001])  # 40001: rows start unaligned
def test_penalties_masks_and_filters_equal_the_per_row_ones_bitwise(vocab: int, threads: int):
    for seed in range(4):
        logits, rows = _batch(seed, n=10, vocab=vocab)
        x = logits[[r.row for r in rows]].clone()
        process_rows(x, rows)
        for j, row in enumerate(rows):
            one = logits[row.row].clone()
            apply_penalties(one, row.params, row.prompt_token_ids, row.output_token_ids)
            if row.allowed is not None:
                one.masked_fill_(~row.allowed, float("-inf"))
            assert torch.equal(x[j], one), (seed, row.params)
        sampled = [j for j, r in enumerate(rows) if not r.params.greedy and torch.isfinite(x[j]).any()]
        probs = filter_rows(x[sampled], [rows[j].params for j in sampled])
        for m, j in enumerate(sampled):
            assert torch.equal(probs[m], filter_logits(x[j], rows[j].params)), (seed, rows[j].params)


def test_an_all_minus_inf_row_fails_alone_and_others_still_draw():
    logits = torch.randn(3, 500)
    logits[1] = float("-inf")
    rows = [
        SamplingRow(r, SamplingParams(temperature=0.9, seed=1), [], [], torch.Generator().manual_seed(r))
        for r in range(3)
    ]
    results = sample_batch(logits, rows)
    assert isinstance(results[1], RuntimeError)
    for r in (0, 2):
        assert results[r] == sample_one(logits[r], rows[r].params, [], [], torch.Generator().manual_seed(r))


def test_an_invalid_bias_raises_before_any_draw():
    logits = torch.randn(2, 100)
    rows = [
        SamplingRow(0, SamplingParams(temperature=1.0), [], [], torch.Generator().manual_seed(0)),
        SamplingRow(1, SamplingParams(temperature=1.0), [], [], torch.Generator().manual_seed(1)),
    ]
    object.__setattr__(rows[1].params, "logit_bias", {105: 1.0})
    before = [r.generator.get_state() for r in rows]
    with pytest.raises(IndexError):
        sample_batch(logits, rows)
    assert all(torch.equal(r.generator.get_state(), b) for r, b in zip(rows, before))


def test_a_seeded_rows_tokens_do_not_depend_on_its_batch_mates():
    vocab = 2000
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.2, seed=7)
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(6, vocab, generator=gen) for _ in range(8)]

    def run(batch_seed: int | None) -> list[int]:
        rng = random.Random(batch_seed)
        mine = torch.Generator().manual_seed(7)
        tokens: list[int] = []
        for logits in steps:
            mates = []
            if batch_seed is not None:
                mates = [
                    SamplingRow(r, _params(rng, vocab), [1, 2], [3], torch.Generator().manual_seed(r))
                    for r in rng.sample([0, 1, 2, 4, 5], rng.randrange(1, 5))
                ]
            rows = [*mates, SamplingRow(3, params, [5, 6], tokens, mine)]
            rng.shuffle(rows)
            result = sample_batch(logits, rows)[rows.index(next(r for r in rows if r.generator is mine))]
            assert not isinstance(result, Exception)
            tokens.append(result[0])
        return tokens

    alone = run(None)
    assert all(run(s) == alone for s in range(4))


@pytest.mark.parametrize("impl", ["extension", "blocked"])
def test_argmax_rows_is_torch_argmax(impl: str):
    if impl == "extension" and cpu_ext.load_or_none() is None:
        pytest.skip(cpu_ext.unavailable_reason() or "the CPU extension did not build")
    argmax_rows = batch_sampler.argmax_rows if impl == "extension" else batch_sampler.blocked_argmax_rows
    gen = torch.Generator().manual_seed(0)
    for vocab in (7, 2 * ARGMAX_BLOCK, 5 * ARGMAX_BLOCK + 3, 49152, 49155):
        rows = max(9, ARGMAX_BLOCKED_MIN // vocab + 1)  # by blocks where there are enough columns
        x = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # ties within and across blocks
        x[1] = float("-inf")
        x[2, vocab // 2] = float("nan")
        x[2, vocab - 1] = float("nan")
        x[3, vocab - 1] = 100.0  # the maximum in the ragged last block
        x[4] = 0.0
        x[4, 0] = -0.0
        x[5, -1] = float("nan")
        x[6, 3] = float("inf")
        assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1)), vocab
        assert torch.equal(argmax_rows(x[:, : vocab - 1]), torch.argmax(x[:, : vocab - 1], dim=-1))
        assert torch.equal(argmax_rows(x.bfloat16()), torch.argmax(x.bfloat16(), dim=-1))
    x = torch.randint(-3, 4, (3, 49152), generator=gen).float()  # few rows: one max(dim) call
    x[1, 7] = x[1, 9] = float("nan")
    x[2] = -0.0
    x[2, 5] = 0.0
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    assert argmax_rows(torch.randn(0, 49152)).shape == (0,)


def test_plain_greedy_rows_take_the_raw_argmax_first_index_on_ties():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1.0  # a tie: the first index wins in both
    logits[4] = 0.0  # all equal
    params = SamplingParams(temperature=0.0)
    singles = [sample_one(logits[r], params, [], [], torch.Generator())[0] for r in range(6)]
    every_row = [SamplingRow(r, params, [], [], torch.Generator()) for r in range(6)]
    assert [t for t, _ in sample_batch(logits, every_row)] == singles  # type: ignore[misc]
    some_rows = [every_row[r] for r in (4, 0, 2)]
    assert [t for t, _ in sample_batch(logits, some_rows)] == [singles[4], singles[0], singles[2]]  # type: ignore[misc]
    assert singles[2] == 10 and singles[4] == 0
    assert sample_batch(logits, []) == []


def test_only_rows_that_take_the_raw_argmax_are_plain():
    assert plain_greedy(SamplingParams(temperature=0.0))
    assert not plain_greedy(SamplingParams(temperature=0.7))
    assert not plain_greedy(SamplingParams(temperature=0.0, logprobs=1))
    assert not plain_greedy(SamplingParams(temperature=0.0, logit_bias={3: 5.0}))
    assert not plain_greedy(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not plain_greedy(SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert not plain_greedy(SamplingParams(temperature=0.0, frequency_penalty=0.5))

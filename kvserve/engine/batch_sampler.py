"""The step's sampling, the whole batch at once: the same tokens and logprobs as `sample_one` row by row.

`sample_batch` applies logit bias, repetition / presence / frequency penalties and grammar masks, then
takes the argmax (greedy rows) or temperature, top-k, top-p and min-p (sampled rows) as tensor ops
over the rows that use each feature; only the draw is per row, with the request's own generator, so a
seeded request's tokens do not depend on its batch-mates. Plain greedy rows (`plain_greedy`, no mask)
take the argmax of the step's logits in place: no row is gathered or copied for them.

Bitwise equal to `sample_one`: every elementwise op is the one `sample_one` does, with its scalar
parameters as float32 tensors (a Python float meets a float32 tensor as float32: same rounding), and
the batched max, top-k, softmax, log-softmax, sort and cumsum treat each row alone, as the 1-D calls
do. The one exception is a 1-D sum, which torch splits over threads: the final normalisation is per
row. tests/unit/test_batch_sampler.py checks it over batches mixing every parameter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.sampler import plain_greedy
from kvserve.kernels import cpu_ext
from kvserve.request import SamplingParams, TokenLogprob

ARGMAX_BLOCK = 256  # columns per block of argmax_rows: about sqrt(vocab) balances its two small searches
# elements from which argmax_rows goes by blocks (3 rows of 49152): below, its ~12 ops cost more
ARGMAX_BLOCKED_MIN = 1 << 17

Sampled = tuple[int, TokenLogprob | None]  # a row's token and, if asked, its logprob
Alternatives = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class SamplingRow:
    """One row of the step's logits to sample, and what its request asks of it."""

    row: int  # its row of the step's logits
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # what the penalties read: the generated tokens, or [] without penalties
    generator: torch.Generator
    allowed: torch.Tensor | None = None  # [vocab] bool: a grammar's mask of allowed next tokens


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [n, vocab] -> [n] long, the same indices: a row's first maximum
    (-0.0 ties +0.0), its first NaN if it has one. torch.argmax's reduction is slow (pairs of value
    and index: 64 us for one row of 49152 floats, 15-20 ms for 128, one core of a Xeon with AMX). On
    CPU, float32 or bf16 rows go to the extension's vectorized `argmax_rows` (csrc/cpu/layer_ops.cpp:
    a max pass, then the first index equal to it, reading bf16 as it is); elsewhere, or without the
    extension, `blocked_argmax_rows`."""
    ext = cpu_ext.load_or_none() if x.device.type == "cpu" else None
    if ext is not None and x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] > 0 and x.stride(1) == 1:
        return ext.argmax_rows(x)
    return blocked_argmax_rows(x)


def blocked_argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax_rows in torch ops. max(dim).indices, a loop that keeps the first maximum and stops at a
    NaN, takes 21 us a row. Past a few rows a vectorized amax per block of ARGMAX_BLOCK columns (0.9 ms
    at [128, 49152] float32, 2 ms bf16) finds the first block holding a row's first maximum; only that
    block is searched."""
    n, vocab = x.shape
    num_blocks = vocab // ARGMAX_BLOCK
    if x.numel() < ARGMAX_BLOCKED_MIN or num_blocks < 2:
        return x.max(dim=-1).indices
    head_cols = num_blocks * ARGMAX_BLOCK
    head = x[:, :head_cols].unflatten(-1, (num_blocks, ARGMAX_BLOCK))  # [n, num_blocks, ARGMAX_BLOCK] view
    block_max = head.amax(dim=-1)  # [n, num_blocks]; amax propagates NaN
    if head_cols < vocab:
        block_max = torch.cat([block_max, x[:, head_cols:].amax(dim=-1, keepdim=True)], dim=1)
    block = block_max.max(dim=-1).indices  # [n]: the first block whose max is the row's
    in_head = block.clamp(max=num_blocks - 1)
    index = in_head * ARGMAX_BLOCK + head[torch.arange(n, device=x.device), in_head].max(dim=-1).indices
    if head_cols < vocab:  # the ragged last block
        in_tail = head_cols + x[:, head_cols:].max(dim=-1).indices
        index = torch.where(block == num_blocks, in_tail, index)
    return index


def sample_batch(logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled | Exception]:
    """logits [n, vocab] (raw model logits, any float dtype) -> per row, what `sample_one` returns for
    it, or the exception its draw raised (probabilities that are not a distribution). Anything else
    raises before any generator draws, so the caller can fall back to `sample_one` per row."""
    plain = [r.allowed is None and plain_greedy(r.params) for r in rows]
    if all(plain) and [r.row for r in rows] == list(range(logits.shape[0])):
        return [(token, None) for token in argmax_rows(logits).tolist()]
    tokens = [0] * len(rows)
    plain_index = [i for i, p in enumerate(plain) if p]
    if plain_index:
        for i, token in zip(plain_index, _argmax_of(logits, [rows[i].row for i in plain_index])):
            tokens[i] = token
    rest = [i for i, p in enumerate(plain) if not p]
    draws: list[tuple[int, torch.Tensor]] = []  # (index in rows, its probabilities [vocab])
    if rest:
        sub = [rows[i] for i in rest]
        x = logits.index_select(0, torch.tensor([r.row for r in sub])).float()  # [k, vocab] our copy
        process_rows(x, sub)
        greedy = [j for j, r in enumerate(sub) if r.params.greedy]
        if greedy:
            for j, token in zip(greedy, argmax_rows(_rows(x, greedy)).tolist()):
                tokens[rest[j]] = token
        sampled = [j for j, r in enumerate(sub) if not r.params.greedy]
        if sampled:
            probs = filter_rows(_rows(x, sampled), [sub[j].params for j in sampled])
            draws = [(rest[j], probs[m]) for m, j in enumerate(sampled)]
    logprobs = _logprobs(logits, rows)
    failed: dict[int, Exception] = {}
    for i, p in draws:  # the draws come last: nothing after the first one raises for the whole batch
        try:
            tokens[i] = int(torch.multinomial(p, 1, generator=rows[i].generator))
        except Exception as e:
            failed[i] = e
    results: list[Sampled | Exception] = []
    for i, token in enumerate(tokens):
        lp = logprobs.get(i)
        logprob = None if lp is None else TokenLogprob(token, float(lp[0][token]), lp[1])
        results.append(failed[i] if i in failed else (token, logprob))
    return results


def _argmax_of(logits: torch.Tensor, row_ids: list[int]) -> list[int]:
    """argmax_rows of some rows: of all rows and keep those when they are most (no copy), else of a copy."""
    if 2 * len(row_ids) >= logits.shape[0]:
        return argmax_rows(logits)[torch.tensor(row_ids)].tolist()
    return argmax_rows(logits.index_select(0, torch.tensor(row_ids))).tolist()


def _rows(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows `index` of x: x itself when that is all of them (then index is 0..k-1 in order)."""
    return x if len(index) == x.shape[0] else x.index_select(0, torch.tensor(index))


def process_rows(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """apply_penalties and the grammar mask of each row of x [len(rows), vocab] float32, in place:
    row j of x is rows[j]'s. Each step touches only the rows that use it."""
    _apply_bias(x, rows)
    _apply_repetition(x, rows)
    _apply_presence_frequency(x, rows)
    _apply_masks(x, rows)


def _apply_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """x[row, id] += bias, as apply_penalties (a gather, an add, a scatter: duplicates as there)."""
    biased = [(j, r.params.logit_bias) for j, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    row_idx = torch.tensor([j for j, bias in biased for _ in bias])
    token_idx = torch.tensor([t for _, bias in biased for t in bias])
    values = torch.tensor([v for _, bias in biased for v in bias.values()], dtype=x.dtype)
    x[row_idx, token_idx] = x[row_idx, token_idx] + values


def _apply_repetition(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each token in a row's prompt or output: divided by the penalty if positive, else multiplied.
    A token listed twice is gathered twice from the same values and written twice with one result."""
    users = [(j, r) for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not users:
        return
    seen = [list(r.prompt_token_ids) + list(r.output_token_ids) for _, r in users]
    counts = torch.tensor([len(s) for s in seen])
    row_idx = torch.tensor([j for j, _ in users]).repeat_interleave(counts)
    token_idx = torch.tensor([t for s in seen for t in s], dtype=torch.long)
    penalty = torch.tensor([r.params.repetition_penalty for _, r in users], dtype=x.dtype)
    penalty = penalty.repeat_interleave(counts)
    vals = x[row_idx, token_idx]
    x[row_idx, token_idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _apply_presence_frequency(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """x[row, id] -= frequency_penalty * count + presence_penalty for each id the row generated."""
    users = [
        (j, r)
        for j, r in enumerate(rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids
    ]
    if not users:
        return
    vocab = x.shape[1]
    outputs = [torch.tensor(list(r.output_token_ids), dtype=torch.long) for _, r in users]
    if any(bool(((o < 0) | (o >= vocab)).any()) for o in outputs):  # the keys below need ids in range;
        raise IndexError("a generated token id is outside the vocabulary")  # sample_one's indexing decides
    keys = torch.cat([m * vocab + o for m, o in enumerate(outputs)])
    keys, counts = torch.unique(keys, return_counts=True)  # one key per (user, token) and its count
    user, token_idx = keys // vocab, keys % vocab
    frequency = torch.tensor([r.params.frequency_penalty for _, r in users], dtype=x.dtype)[user]
    presence = torch.tensor([r.params.presence_penalty for _, r in users], dtype=x.dtype)[user]
    row_idx = torch.tensor([j for j, _ in users])[user]
    x[row_idx, token_idx] = x[row_idx, token_idx] - (frequency * counts.to(x.dtype) + presence)


def _apply_masks(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf wherever a row's grammar does not allow the token."""
    masked = [j for j, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return
    allowed = torch.stack([rows[j].allowed for j in masked])  # type: ignore[misc]  # [m, vocab] bool
    index = torch.tensor(masked)
    x[index] = _rows(x, masked).masked_fill(~allowed, float("-inf"))


def filter_rows(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """filter_logits of each row of x [k, vocab] float32 with params[j] -> probabilities [k, vocab]."""
    temperature = torch.tensor([p.temperature for p in params], dtype=x.dtype)[:, None]
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature
    vocab = x.shape[1]
    by_top_k: dict[int, list[int]] = defaultdict(list)
    for j, p in enumerate(params):
        if 0 < p.top_k < vocab:
            by_top_k[p.top_k].append(j)
    for top_k, index in by_top_k.items():
        sub = _rows(x, index)
        kth = torch.topk(sub, top_k).values[:, -1:]
        x[torch.tensor(index)] = sub.masked_fill(sub < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        sub = _rows(probs, nucleus)
        top_p = torch.tensor([params[j].top_p for j in nucleus], dtype=x.dtype)[:, None]
        sorted_probs, order = torch.sort(sub, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs > top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs[torch.tensor(nucleus)] = sub.masked_fill(drop, 0.0)
    floor = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if floor:
        sub = _rows(probs, floor)
        min_p = torch.tensor([params[j].min_p for j in floor], dtype=x.dtype)[:, None]
        probs[torch.tensor(floor)] = sub.masked_fill(sub < min_p * sub.amax(dim=-1, keepdim=True), 0.0)
    sums = torch.stack([p.sum() for p in probs])  # per row: torch splits a long 1-D sum over threads
    return probs / sums[:, None]


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, tuple[torch.Tensor, Alternatives]]:
    """index in rows -> (the raw model log-softmax [vocab], its top alternatives), for rows that ask.
    Top-k runs once per distinct k (a top-k of more would order tied values its own way)."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asking:
        return {}
    raw = logits.index_select(0, torch.tensor([rows[i].row for i in asking])).float()
    logprobs = torch.log_softmax(raw, dim=-1)  # [m, vocab]
    by_k: dict[int, list[int]] = defaultdict(list)
    for m, i in enumerate(asking):
        by_k[rows[i].params.logprobs or 0].append(m)
    alternatives: dict[int, Alternatives] = {m: [] for m in by_k.get(0, [])}
    for k, members in by_k.items():
        if k > 0:
            top = torch.topk(_rows(logprobs, members), k)
            for m, ids, values in zip(members, top.indices.tolist(), top.values.tolist()):
                alternatives[m] = list(zip(ids, values))
    return {i: (logprobs[m], alternatives[m]) for m, i in enumerate(asking)}

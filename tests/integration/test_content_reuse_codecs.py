"""Content reuse under every KV codec: the blend leaves what the codec makes of the same rows.

For each codec and each layer, the oracle takes the rows the sequence must end up with: moved rows
(the source's KV as the codec decodes it, K rotated to the new positions) where the layer did not
recompute them, the forward's fresh K/V where it did; writes them once, in position order, into a
clean pool of the same codec; and must equal, bit for bit, what the blend left in the sequence's
blocks. Prompts put hits mid-block, fresh rows at offset 0 of blocks holding moved rows, and repair
rows into blocks that moved rows had already filled, in blocks recycled from earlier requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache.quantized_storage import create_layer_kv
from kvserve.quant.registry import CODEC_NAMES, head_dim_problem
from kvserve.request import ReuseOptions
from kvserve.reuse.plan import ReusePlan
from tests.integration.helpers import corpus_token_ids

CHUNK = 32
HEAD_DIM = 16  # tiny-random-llama
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SELECTIVE = ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=5)
BLEND = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.3, blend_check_layer=1)
FULL_BLEND = ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=1.0)


def _codec_params() -> list[Any]:
    params = []
    for name in CODEC_NAMES:
        problem = head_dim_problem(name, HEAD_DIM)
        marks = pytest.mark.skip(reason=f"{name} needs {problem}") if problem else ()
        params.append(pytest.param(name, marks=marks))
    return params


def _moved_rows(llm: LLM, plan: ReusePlan, layer_idx: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """position -> the source's K/V as the codec decodes it, K rotated to the position."""
    repairer = llm.engine.reuse.repairer
    assert repairer is not None
    kv = llm.engine.layers[layer_idx]
    src = torch.tensor([s for h in plan.hits for s in h.hit.src_slots])
    dst = [p for h in plan.hits for p in range(h.dst_start, h.dst_start + h.num_tokens)]
    delta = torch.cat([torch.full((h.num_tokens,), h.delta) for h in plan.hits])
    k, v = kv.read_slots(src)
    k = repairer.rotator.apply(k, repairer.rotator.rotation(delta, k.device))
    return {p: (k[i], v[i]) for i, p in enumerate(dst)}


def _check_against_oracle(
    llm: LLM, codec: str, plan: ReusePlan, forward_writes: list[list[tuple]]
) -> set[str]:
    """Compare every layer's assembled blocks with the oracle; returns which hard cases occurred.
    forward_writes[layer]: the repair's writes in order (its pieces and passes; a later write of a
    position replaces an earlier one)."""
    bs = llm.engine.config.block_size
    n, prefix_len = plan.seq.num_prompt_tokens, plan.prefix_len
    assert prefix_len % bs == 0
    seq_blocks = llm.engine.kv.block_ids(plan.seq.request_id)
    block_ids = torch.tensor(seq_blocks[prefix_len // bs : -(-n // bs)])
    pos_of_block = {b: i * bs for i, b in enumerate(seq_blocks)}
    moved = {p for h in plan.hits for p in range(h.dst_start, h.dst_start + h.num_tokens)}
    cases = set()
    if any(h.dst_start % bs for h in plan.hits):
        cases.add("hit starts mid-block")
    for layer_idx, kv in enumerate(llm.engine.layers):
        rows = _moved_rows(llm, plan, layer_idx)
        computed = []
        for slots, k, v in forward_writes[layer_idx]:
            at = [pos_of_block[s // bs] + s % bs for s in slots.tolist()]
            computed += at
            for i, p in enumerate(at):
                rows[p] = (k[i], v[i])
        assert sorted(rows) == list(range(prefix_len, n)), "every row past the prefix is written"
        cases |= _cases(set(computed), moved, bs)
        oracle = create_layer_kv(
            codec, len(block_ids), bs, kv.num_kv_heads, kv.head_dim, kv.compute_dtype, "cpu", layer_idx
        )
        order = sorted(
            rows
        )  # position order; oracle block i holds positions prefix_len + [i * bs, (i + 1) * bs)
        oracle.write(
            torch.tensor(order) - prefix_len,
            torch.stack([rows[p][0] for p in order]),
            torch.stack([rows[p][1] for p in order]),
        )
        got, want = kv.gather(block_ids), oracle.gather(torch.arange(len(block_ids)))
        for what, a, b in zip("KV", got, want, strict=True):
            a, b = a.flatten(0, 1)[: n - prefix_len], b.flatten(0, 1)[: n - prefix_len]
            bad = (prefix_len + (a != b).any(dim=(1, 2)).nonzero().squeeze(1)).tolist()
            assert not bad, f"{codec} layer {layer_idx}: {what} differs from the oracle at positions {bad}"
    return cases


def _cases(computed: set[int], moved: set[int], bs: int) -> set[str]:
    cases = set()
    for start in range(min(moved) // bs * bs, max(moved) + 1, bs):
        block = set(range(start, start + bs))
        if start in computed and block & moved:
            cases.add("offset-0 write into a block holding moved rows")
        if block <= moved and block & computed and not block <= computed:
            cases.add("repair of some rows of a block that moved rows filled")
    return cases


def _spy(
    llm: LLM, codec: str, earlier_blocks: set[int], cases: list[set[str]], failures: list[str]
) -> Callable[[], None]:
    """Wrap the repairer: record each layer's writes from the move to the repair's end (the pieces
    of every pass, whatever steps they ran in), then check the oracle."""
    engine = llm.engine
    repairer = engine.reuse.repairer
    assert repairer is not None
    begin, finish = repairer.begin, repairer.finish
    writes: list[list[tuple]] = []

    def recording_begin(seq, repair):  # type: ignore[no-untyped-def]
        moved = begin(seq, repair)
        writes[:] = [[] for _ in engine.layers]
        for idx, kv in enumerate(engine.layers):
            write = kv.write

            def record(slot_mapping, key, value, _w=write, _idx=idx):  # type: ignore[no-untyped-def]
                writes[_idx].append((slot_mapping.clone(), key.clone(), value.clone()))
                _w(slot_mapping, key, value)

            kv.write = record  # type: ignore[method-assign]
        return moved

    def checking_finish(seq, repair):  # type: ignore[no-untyped-def]
        for kv in engine.layers:
            del kv.write
        plan = repair.plan
        try:  # the engine turns an exception in here into a failed request: keep it for the test
            cases.append(_check_against_oracle(llm, codec, plan, writes))
            if earlier_blocks & set(engine.kv.block_ids(seq.request_id)):
                cases[-1].add("block recycled from an earlier owner")
        except AssertionError as e:
            failures.append(str(e))
        return finish(seq, repair)

    repairer.begin = recording_begin  # type: ignore[method-assign]
    repairer.finish = checking_finish  # type: ignore[method-assign]

    def restore() -> None:
        repairer.begin, repairer.finish = begin, finish  # type: ignore[method-assign]

    return restore


@pytest.mark.parametrize("codec", _codec_params())
def test_content_reuse_equals_the_codec_on_the_same_moved_kv(codec):
    llm = LLM(
        model="tiny-random-llama",
        chunk_size=CHUNK,
        max_cache_bytes=_bytes_for_blocks(codec, 32),  # small: blocks come back from earlier owners
        max_num_seqs=4,
        kv_cache_dtype=codec,
        pieces="content",
        piece_min_tokens=8,
        reuse_min_saving=-10.0,  # take every match: the full repair too
    )
    docs = [corpus_token_ids(llm, 70 + 20 * i, seed=80 + i) for i in range(2)]
    for d in docs:
        llm.warm(d)
    pool = llm.engine.pool
    doc_blocks = {b for b, refs in enumerate(pool.ref_counts) if refs}
    head, gap, tail = (corpus_token_ids(llm, m, seed=90 + m) for m in (21, 5, 7))
    prompt = head + docs[1] + gap + docs[0] + tail  # hits start mid-block
    # the codec's full prefill, under another namespace (no matches); its cached chunks are evicted
    # for the next sequences, which get those blocks back with its codes still in them
    (ref,) = llm.generate([prompt], GREEDY, cache_salt="cold")
    earlier_blocks = {b for b, refs in enumerate(pool.ref_counts) if refs} - doc_blocks
    cases: list[set[str]] = []
    failures: list[str] = []
    restore = _spy(llm, codec, earlier_blocks, cases, failures)
    try:
        outs = [llm.generate([prompt], GREEDY, reuse=opts)[0] for opts in (SELECTIVE, BLEND, FULL_BLEND)]
    finally:
        restore()
    assert not failures, "\n".join(failures)
    assert set.union(*cases) == {
        "hit starts mid-block",
        "offset-0 write into a block holding moved rows",
        "repair of some rows of a block that moved rows filled",
        "block recycled from an earlier owner",
    }
    assert all(o.num_approx_cached_tokens + o.num_recomputed_tokens >= 100 for o in outs)
    assert outs[2].num_approx_cached_tokens == 0
    assert outs[2].token_ids == ref.token_ids  # full repair equals the codec's full prefill
    llm.engine.check_integrity()


def _bytes_for_blocks(codec: str, num_blocks: int) -> int:
    """max_cache_bytes that gives tiny-random-llama (4 layers, 2 KV heads) about num_blocks blocks."""
    kv = create_layer_kv(codec, 1, 16, 2, HEAD_DIM, torch.float32)
    per_block = 4 * kv.bytes_per_block()
    open_block_reserve = 4 * 4 * 16 * 2 * HEAD_DIM * 4 * (not kv.per_token)  # 4 seqs' fp32 K blocks
    return num_blocks * per_block + open_block_reserve

"""Test fixtures: random packed batches over a paged pool, for the kernel tests (tests/kernels/) and
scripts/bench_kernels.py. Not used by the server."""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionMetadata, SeqRows
from kvserve.kvcache.block_pool import slot_mapping
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV


def allocate_blocks(num_blocks_per_seq: list[int], layout: str, seed: int = 0) -> list[list[int]]:
    """Block ids per sequence. layout: contiguous (a fresh pool), shuffled (every block apart),
    mixed (runs of 1 to 8 consecutive blocks in random order)."""
    total = sum(num_blocks_per_seq)
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        order = list(range(1, total + 1))
    elif layout == "shuffled":
        order = (torch.randperm(total, generator=gen) + 1).tolist()
    elif layout == "mixed":
        runs, start = [], 1
        while start <= total:
            n = int(torch.randint(1, 9, (1,), generator=gen))
            runs.append(list(range(start, min(start + n, total + 1))))
            start += n
        order = [b for i in torch.randperm(len(runs), generator=gen).tolist() for b in runs[i]]
    else:
        raise ValueError(layout)
    tables, at = [], 0
    for n in num_blocks_per_seq:
        tables.append(order[at : at + n])
        at += n
    return tables


def make_batch(
    lens: list[tuple[int, int]],  # (q_len, seq_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    layout: str = "mixed",
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, DenseLayerKV, AttentionMetadata]:
    """query [sum q_len, H, D], a pool holding every sequence's KV (block 0 unused), metadata."""
    # drawn where they live: the same values as before on CPU, and no CPU round trip for GPU benchmarks
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for _, s in lens]
    tables = allocate_blocks(blocks_per_seq, layout, seed)
    num_blocks = sum(blocks_per_seq) + 1
    kv = DenseLayerKV(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    # unwritten slots hold garbage on purpose: a kernel reading past seq_len shows up
    kv.k_cache.copy_(torch.randn(kv.k_cache.shape, generator=gen, device=device) * 100)
    kv.v_cache.copy_(torch.randn(kv.v_cache.shape, generator=gen, device=device) * 100)
    for table, (_, seq_len) in zip(tables, lens, strict=True):
        slots = slot_mapping(torch.tensor(table), torch.arange(seq_len), block_size)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device)
        kv.write(slots.to(device), k, v)
    rows = [SeqRows(t, torch.arange(s - q, s), s) for t, (q, s) in zip(tables, lens, strict=True)]
    meta = AttentionMetadata.build(rows, block_size, device, write=False)
    q_lens = meta.query_lens_list
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    return query, kv, meta


def quantized_copy(
    kv: DenseLayerKV, meta: AttentionMetadata, codec: str, compute_dtype: torch.dtype
) -> LayerKV:
    """The batch's KV in a `codec` pool (kvserve/quant/), each sequence's tokens written in order, so
    a sequence's last partial block stays open (int8 KIVI keeps that block's K in its shadow)."""
    from kvserve.kvcache.quantized_storage import create_layer_kv

    out = create_layer_kv(
        codec, kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, compute_dtype, kv.k_cache.device
    )
    flat = (-1, kv.num_kv_heads, kv.head_dim)
    for i, seq_len in enumerate(meta.seq_lens_list):
        blocks = meta.block_tables[i, : -(-seq_len // kv.block_size)]
        slots = slot_mapping(blocks, torch.arange(seq_len, device=blocks.device), kv.block_size)
        out.write(slots, kv.k_cache.view(flat)[slots], kv.v_cache.view(flat)[slots])
    return out

"""Paged attention on CPU directly over the block table, without gathering the whole history.

With the C++ extension (csrc/cpu/, kvserve/kernels/cpu_ext.py; the default wherever a compiler
exists), every row of the step goes to one kernel call per layer: prefill, chunked prefill and
decode rows alike, and rows at explicit positions (`AttentionMetadata.query_positions`). The kernel
reads dense (any float dtype), fp8_e4m3 and int8 KIVI pools in place; other codecs are first decoded
into a dense copy of the blocks the step references, or read from decoded copies the pool keeps
across steps (--kv-decoded-bytes) (attention/base.py: `dense_copy`; decoding is per block, so a
block decodes to the same values in every step, kept or not). It is batch invariant: a row's
output is bitwise a function of its query, its position and the KV it attends to, whatever the
batch, the split of the prompt into steps, the rows around it and the thread count.

Without the extension (no compiler, `KVSERVE_CPU_EXT=0`, `use_extension=False`, or a head_dim the
extension lacks) the torch-ops path below runs. It is correct to fp32 rounding but NOT batch
invariant: a row's reduction order depends on how its sequence was cut into steps and spans, so
warm and cold (or batched and alone) results can differ in the last bits, and a quantized KV cache
can turn that into different greedy tokens (docs/kernels.md). Its plan: a sequence's blocks are cut
into spans (`plan_spans`): a run of at least MIN_VIEW_BLOCKS consecutive block ids is a strided view
of a dense pool (no copy); shorter runs are gathered in groups of about GATHER_BYTES of K (a copy
small enough to stay in cache while it is used). Decode rows on a dense pool take two torch passes
(scores of all spans, one softmax, then P V span by span). Other rows run torch's CPU
flash-attention kernel per span, which returns the log-sum-exp, and partial results are merged
exactly (the flash-decoding merge). Spans are further cut at ctx_len = seq_len - q_len: every query
row sees all of [0, ctx_len); of a span in [ctx_len, seq_len) the rows that see nothing are dropped
and the rest see it top-left causally. So no mask tensor is built. Non-dense pools are read through
`LayerKV.gather`, span by span.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, dense_copy
from kvserve.attention.reference import ReferenceBackend
from kvserve.kernels import cpu_ext
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV

MIN_VIEW_BLOCKS = 16  # shorter runs of consecutive blocks are gathered instead of viewed
GATHER_BYTES = 1 << 20  # K bytes per gathered span: fits this machine's 2 MiB L2
# Rows per step over which a span's flash call and merge are spread: with many rows (prefill) the
# work is compute-bound and fewer, larger spans win (about 5 % at 256 rows over 2k), up to 16x.
ROWS_PER_GATHER_STEP = 16
MAX_GATHER_SCALE = 16

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class KVSpan:
    """Table entries [first_block, first_block + num_blocks) holding token positions [start, end)."""

    first_block: int
    num_blocks: int
    start: int
    end: int
    is_view: bool  # the blocks are consecutive ids: read as a view of the pool


def block_runs(block_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids in a 1-D table: [(index of the run's first entry, length)]."""
    n = block_ids.numel()
    if n == 0:
        return []
    breaks = ((block_ids[1:] - block_ids[:-1]) != 1).nonzero().flatten().add_(1).tolist()
    edges = [0, *breaks, n]
    return [(a, b - a) for a, b in zip(edges[:-1], edges[1:], strict=False)]


def plan_spans(
    block_ids: torch.Tensor, seq_len: int, block_size: int, gather_blocks: int, can_view: bool
) -> list[KVSpan]:
    """Spans covering [0, seq_len) in order: long runs as views, the rest in gathered groups."""
    spans: list[KVSpan] = []
    first, count = 0, 0  # table entries [first, first + count) waiting to be gathered

    def add(at: int, num: int, is_view: bool) -> None:
        end = min((at + num) * block_size, seq_len)
        spans.append(KVSpan(at, num, at * block_size, end, is_view))

    for run_first, length in block_runs(block_ids):
        if can_view and length >= MIN_VIEW_BLOCKS:
            if count:
                add(first, count, False)
                count = 0
            add(run_first, length, True)
            continue
        if count == 0:
            first = run_first
        count += length  # short runs are adjacent in the table: the group stays one range
        while count >= gather_blocks:
            add(first, gather_blocks, False)
            first, count = first + gather_blocks, count - gather_blocks
    if count:
        add(first, count, False)
    return spans


def _read(cache: torch.Tensor, block_ids: torch.Tensor, span: KVSpan) -> torch.Tensor:
    """One span of a dense cache [num_blocks, bs, H_kv, D] -> [end - start, H_kv, D]."""
    h_kv, d = cache.shape[2], cache.shape[3]
    if span.is_view:
        b0 = int(block_ids[span.first_block])
        blocks = cache[b0 : b0 + span.num_blocks]
    else:
        blocks = cache.index_select(0, block_ids[span.first_block : span.first_block + span.num_blocks])
    return blocks.view(-1, h_kv, d)[: span.end - span.start]


def _kv_spans(
    kv: LayerKV, block_ids: torch.Tensor, spans: list[KVSpan]
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first token position, K, V) per span; K/V [n, H_kv, D]."""
    for span in spans:
        if isinstance(kv, DenseLayerKV):
            yield span.start, _read(kv.k_cache, block_ids, span), _read(kv.v_cache, block_ids, span)
            continue
        k, v = kv.gather(block_ids[span.first_block : span.first_block + span.num_blocks])
        n = span.end - span.start
        yield (
            span.start,
            k.view(-1, kv.num_kv_heads, kv.head_dim)[:n],
            v.view(-1, kv.num_kv_heads, kv.head_dim)[:n],
        )


def _split_at(
    spans: Iterator[tuple[int, torch.Tensor, torch.Tensor]], pos: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Cuts the one span that straddles token position `pos` in two."""
    for start, k, v in spans:
        end = start + k.shape[0]
        if start < pos < end:
            yield start, k[: pos - start], v[: pos - start]
            yield pos, k[pos - start :], v[pos - start :]
        else:
            yield start, k, v


def decode_dense(
    q: torch.Tensor,  # [H, D]
    kv: DenseLayerKV,
    block_ids: torch.Tensor,  # [num_blocks] int64
    spans: list[KVSpan],
    scale: float,
) -> torch.Tensor:  # [H, D]
    """One decode row: scores of every span, one softmax, then P V span by span."""
    h, d = q.shape
    h_kv = kv.num_kv_heads
    qg = (q * scale).view(h_kv, h // h_kv, d)  # [H_kv, G, D]: GQA group as GEMM rows
    scores = [torch.matmul(qg, _read(kv.k_cache, block_ids, s).to(q.dtype).permute(1, 2, 0)) for s in spans]
    all_scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)  # [H_kv, G, seq_len]
    probs = torch.softmax(all_scores.float(), dim=-1).to(q.dtype)
    out = None
    for span in spans:
        v = _read(kv.v_cache, block_ids, span).to(q.dtype).transpose(0, 1)  # [H_kv, n, D]
        part = torch.matmul(probs[..., span.start : span.end], v)  # [H_kv, G, D]
        out = part if out is None else out.add_(part)
    assert out is not None, "seq_len must be >= 1"
    return out.view(h, d)


def _partial_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, 1, D] (scaled), k/v [n, H_kv, D] -> (o [1, H, 1, D], lse [1, H, 1]) for the merge."""
    _, h, _, d = q.shape
    h_kv = k.shape[1]
    scores = torch.matmul(q.view(h_kv, h // h_kv, d), k.permute(1, 2, 0)).float()  # [H_kv, G, n]
    lse = torch.logsumexp(scores, dim=-1)  # [H_kv, G]
    o = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v.transpose(0, 1))
    return o.view(1, h, 1, d), lse.view(1, h, 1)


def _merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor) -> None:
    """In place: (o_acc, lse_acc) <- the union of two partial results over disjoint KV.

    o [H, rows, D] float32, lse [H, rows] float32; lse_acc is finite (the first span covers all rows).
    """
    lse_max = torch.maximum(lse_acc, lse_new)
    w_acc = torch.exp(lse_acc - lse_max)
    w_new = torch.exp(lse_new - lse_max)
    total = w_acc + w_new
    o_acc.mul_((w_acc / total).unsqueeze(-1)).add_(o_new * (w_new / total).unsqueeze(-1))
    lse_acc.copy_(lse_max + torch.log(total))


def attention_merged(
    q: torch.Tensor,  # [q_len, H, D]
    kv: LayerKV,
    block_ids: torch.Tensor,  # [num_blocks] int64
    spans: list[KVSpan],
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, H, D]
    """Any rows, any LayerKV: per-span partial attention, merged through the log-sum-exp."""
    q_len = q.shape[0]
    ctx_len = seq_len if q_len == 1 else seq_len - q_len
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D] view
    if q_len == 1:
        qh = qh * scale
    o_acc = lse_acc = None
    for start, k, v in _split_at(_kv_spans(kv, block_ids, spans), ctx_len):
        first_row = max(0, start - ctx_len)  # rows before it see nothing of a new-token span
        k, v = k.to(q.dtype), v.to(q.dtype)
        if q_len == 1:
            o, lse = _partial_decode(qh, k, v)
        else:
            k4, v4 = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, H_kv, n, D]
            o, lse = _flash_cpu(qh[:, :, first_row:], k4, v4, is_causal=start >= ctx_len, scale=scale)
        if o_acc is None:
            if start + k.shape[0] >= seq_len:
                return o[0].transpose(0, 1)  # one span: no merge
            o_acc, lse_acc = o[0].float(), lse[0].float()  # [H, q_len, D], [H, q_len]
            continue
        _merge(o_acc[:, first_row:], lse_acc[:, first_row:], o[0].float(), lse[0].float())
    assert o_acc is not None, "seq_len must be >= 1"
    return o_acc.transpose(0, 1).to(q.dtype)


def extension_attention(
    ext: ModuleType,
    query: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Every row of the step through the extension's batch-invariant kernel (kv.head_dim must be in
    cpu_ext.HEAD_DIMS); pools it cannot read in place through a dense copy of the referenced blocks."""
    pool = cpu_ext.readable_pool(kv)
    block_tables = meta.block_tables
    if pool is None:
        k, v, block_tables = dense_copy(kv, meta.block_tables, query.dtype)
        pool = PagedKV("dense", k, v)
    return cpu_ext.attention(
        ext,
        query,
        pool,
        block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        meta.query_positions,
        window,
    )


class CpuPagedBackend(AttentionBackend):
    """cpu_paged: every row through the C++ extension where it is available (batch invariant), else
    per sequence over views and small gathers of the paged pool with torch ops (module doc).
    `use_extension=False` keeps to torch ops."""

    name = "cpu_paged"
    takes_window = True

    def __init__(self, use_extension: bool = True):
        self.ext = cpu_ext.load_or_none() if use_extension else None

    @classmethod
    def is_available(
        cls, device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """CPU tensors only (the C++ extension, torch's CPU flash kernel); any head_dim and dtype (what
        the extension does not take goes through torch ops)."""
        if device.type == "cpu":
            return True, ""
        return False, (
            f"cpu_paged runs on CPU tensors only, got device {device}: use --attention-backend auto "
            "(triton or the cuda extension, else the slow torch reference) or --device cpu"
        )

    def handles_positions(self, head_dim: int) -> bool:
        return self.ext is not None and head_dim in cpu_ext.HEAD_DIMS

    def forward(
        self,
        query: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if self.ext is not None and kv.head_dim in cpu_ext.HEAD_DIMS:
            return extension_attention(self.ext, query, kv, meta, scale, window)
        assert meta.query_positions is None, "rows at arbitrary positions: use the positional backend"
        if window:  # the torch-ops spans have no lower edge: the reference's explicit mask
            return ReferenceBackend().forward(query, kv, meta, scale, window)
        return torch_ops_attention(query, kv, meta, scale)


def torch_ops_attention(
    query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The no-extension path: per sequence, over views and small gathers (not batch invariant)."""
    out = torch.empty_like(query)
    dense = isinstance(kv, DenseLayerKV)
    bytes_per_block = kv.block_size * kv.num_kv_heads * kv.head_dim * query.element_size()
    min_gather_blocks = max(1, GATHER_BYTES // bytes_per_block)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        num_blocks = -(-seq_len // meta.block_size)
        block_ids = meta.block_tables[i, :num_blocks].long()
        gather_blocks = min_gather_blocks * min(MAX_GATHER_SCALE, max(1, q_len // ROWS_PER_GATHER_STEP))
        spans = plan_spans(block_ids, seq_len, meta.block_size, gather_blocks, dense)
        q = query[start : start + q_len]
        if q_len == 1 and isinstance(kv, DenseLayerKV):
            out[start] = decode_dense(q[0], kv, block_ids, spans, scale)
        else:
            out[start : start + q_len] = attention_merged(q, kv, block_ids, spans, seq_len, scale)
        start += q_len
    return out

"""The attention backend interface and the per-step metadata every backend reads.

Layout conventions (one packed batch per step):
  query        [num_tokens, num_heads, head_dim]      all sequences' new tokens, concatenated
  KV pool      read through a `LayerKV` (kvserve/kvcache/kv_storage.py); dense pools are
               [num_blocks, block_size, num_kv_heads, head_dim]
  sequence i   owns query rows [query_start_loc[i], query_start_loc[i+1]) and has seq_lens[i]
               tokens of KV (cached context + its new tokens, already written to the pool before
               attention runs). Its new tokens sit at the END of its context, so the causal mask
               is aligned bottom-right: query row j (0-based within the sequence, q_len rows) sees
               KV positions [0, seq_len - q_len + j].
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvserve.kvcache.block_pool import batch_slot_mapping
from kvserve.kvcache.kv_storage import LayerKV


@dataclass
class SeqRows:
    """One sequence's part of a forward: its blocks, the absolute positions of its query rows (their
    KV is written to those positions' slots), and its KV length once they are written."""

    block_ids: list[int]
    positions: torch.Tensor  # [q_len] int64
    seq_len: int


@dataclass
class AttentionMetadata:
    """Built once per forward by `AttentionMetadata.build` (ModelRunner.prepare_inputs, the kernel
    tests' fixtures); read by every layer."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length per sequence (context + new tokens)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, pool slot of each new token; -1 = do not write
    query_lens_list: list[int]  # python copies for CPU loops and launch grids
    seq_lens_list: list[int]
    block_size: int
    # Set when the step has rows at chosen positions (content-reuse repair): the absolute position of
    # every query row. A row at position p sees KV positions [0, p]. None = the bottom-right rule above.
    query_positions: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        seqs: list[SeqRows],
        block_size: int,
        device: torch.device | str,
        *,
        write: bool = True,  # False: slot_mapping all -1 (the KV is in the pool already)
        explicit_positions: bool = False,  # True: set query_positions (rows need not end their sequence)
        positions: torch.Tensor | None = None,  # the seqs' positions concatenated, when the caller has them
    ) -> AttentionMetadata:
        """The one place query offsets, block tables and slot mappings are made (with `decode`, through
        `_from_lists`): a few tensor ops over the whole batch (no tensor per sequence), so a step's cost
        does not grow with Python per row."""
        q_lens = [len(s.positions) for s in seqs]
        if positions is None:
            positions = torch.cat([s.positions for s in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
        return cls._from_lists(
            [s.block_ids for s in seqs],
            q_lens,
            [s.seq_len for s in seqs],
            positions.to("cpu", torch.int64),
            block_size,
            device,
            write=write,
            explicit_positions=explicit_positions,
        )

    @classmethod
    def decode(
        cls, tables: list[list[int]], positions: list[int], block_size: int, device: torch.device | str
    ) -> AttentionMetadata:
        """`build` for a step of one row per sequence, each at the end of its KV (a plain decode
        step): the same tensors from the tables and positions as lists, without a SeqRows or a
        positions tensor per sequence."""
        seq_lens = [p + 1 for p in positions]
        rows = torch.tensor(positions, dtype=torch.int64)
        return cls._from_lists(tables, [1] * len(tables), seq_lens, rows, block_size, device)

    @classmethod
    def _from_lists(
        cls,
        tables: list[list[int]],
        q_lens: list[int],
        seq_lens: list[int],
        positions: torch.Tensor,  # [num_rows] int64 on the CPU, the sequences' rows concatenated
        block_size: int,
        device: torch.device | str,
        *,
        write: bool = True,
        explicit_positions: bool = False,
    ) -> AttentionMetadata:
        """build's tensors from per-sequence lists (see build's arguments)."""
        n = len(tables)
        num_blocks = [len(t) for t in tables]
        width = max(num_blocks, default=0)
        padded = [t if k == width else t + [0] * (width - k) for t, k in zip(tables, num_blocks)]
        block_tables = torch.tensor(padded, dtype=torch.int32).reshape(n, width)
        query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        if write and len(positions) <= SMALL_BATCH_ROWS:  # a few rows: Python ints beat six tensor ops
            slot_tensor = torch.tensor(
                _slots(padded, num_blocks, q_lens, positions.tolist(), block_size), dtype=torch.int64
            )
        elif write:
            lengths = torch.tensor(q_lens, dtype=torch.int64)
            seq_index = (
                torch.arange(n) if q_lens.count(1) == n else torch.repeat_interleave(torch.arange(n), lengths)
            )
            slot_tensor = batch_slot_mapping(
                block_tables, torch.tensor(num_blocks), seq_index, positions, block_size
            )
        else:
            slot_tensor = torch.full((len(positions),), -1, dtype=torch.int64)
        return cls(
            query_start_loc=query_start_loc.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=slot_tensor.to(device),
            query_lens_list=q_lens,
            seq_lens_list=seq_lens,
            block_size=block_size,
            query_positions=positions.to(device) if explicit_positions else None,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)


SMALL_BATCH_ROWS = 32  # rows up to which AttentionMetadata.build maps slots in Python (_slots)


def _slots(
    tables: list[list[int]], num_blocks: list[int], q_lens: list[int], positions: list[int], block_size: int
) -> list[int]:
    """batch_slot_mapping in Python ints, for a few rows."""
    slots: list[int] = []
    for table, blocks, n in zip(tables, num_blocks, q_lens, strict=True):
        for p in positions[len(slots) : len(slots) + n]:
            if p // block_size >= blocks:
                raise IndexError("a position past its sequence's blocks")
            slots.append(table[p // block_size] * block_size + p % block_size)
    return slots


class AttentionBackend(ABC):
    """Computes causal attention of the step's queries over each sequence's paged KV.

    Rules: the output for a sequence depends only on that sequence's query rows and KV blocks
    (batching is invisible); GQA is handled inside (num_heads % num_kv_heads == 0); the result has
    the dtype of `query`.
    """

    name: str = "base"
    # Whether forward takes `window` (a sliding-window layer: a row at position p sees (p - window, p]);
    # a model with such layers runs only on a backend that does (registry.create_backend).
    takes_window: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    @classmethod
    def is_available(
        cls, device: torch.device, *, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """(available, reason if not) for this device and, when given, the model's head_dim and dtype."""
        return True, ""

    def handles_positions(self, head_dim: int) -> bool:
        """Whether it takes rows at explicit positions (`AttentionMetadata.query_positions`); the
        model runner sends batches with such rows to PositionalBackend otherwise."""
        return False


def dense_copy(
    kv: LayerKV, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, block_tables) for kernels that cannot read `kv`'s format: the layer's kept decoded blocks
    where it keeps them (LayerKV.decoded_view), else K/V of only the blocks the table references,
    decoded now, densely in `dtype` ([n_used, block_size, H_kv, D]); and the table remapped."""
    kept = kv.decoded_view(block_tables, dtype)
    if kept is not None:
        return kept
    used, remapped = torch.unique(block_tables.long(), return_inverse=True)  # sorted ids, [S, max_blocks]
    k, v = kv.gather(used)
    return k.to(dtype).contiguous(), v.to(dtype).contiguous(), remapped.to(torch.int32)

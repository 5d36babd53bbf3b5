"""ModelRunner: ScheduledBatch -> packed tensors -> model forward -> logits of the sampled rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.forward_context import ForwardContext, forward_context
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.models.hf_adapter import PoolCache
from kvserve.scheduler.batch import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, num_tokens] int64
    position_ids: torch.Tensor  # [1, num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the packed batch whose logits are needed


class ModelRunner:
    def __init__(self, model: Any, layers: list[LayerKV], backend: AttentionBackend, device: torch.device):
        self.model = model
        self.decoder = model.model
        self.lm_head = model.get_output_embeddings()
        self.layers = layers
        self.backend = backend
        self.device = device
        self.block_size = layers[0].block_size
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The only place positions, slot mappings and block tables are built."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for item in batch.items:
            seq, start = item.seq, item.seq.kv.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.kv.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            if item.sample:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(item.seq.kv.block_ids) for item in batch.items)
        block_tables = torch.zeros((len(batch.items), max_blocks), dtype=torch.int32)
        for i, item in enumerate(batch.items):
            block_tables[i, : len(item.seq.kv.block_ids)] = torch.tensor(
                item.seq.kv.block_ids, dtype=torch.int32
            )
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=query_start_loc.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Runs the step; returns float32 logits [num_sampled, vocab] in batch order of sampled items."""
        inputs = self.prepare_inputs(batch)
        with forward_context(ForwardContext(self.layers, self.backend, inputs.meta)):
            hidden = self.decoder(
                input_ids=inputs.input_ids,
                position_ids=inputs.position_ids,
                past_key_values=PoolCache(),
                use_cache=True,
            ).last_hidden_state  # [1, num_tokens, hidden]
        hidden = hidden[0].index_select(0, inputs.logits_indices)
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

"""ModelRunner: ScheduledBatch -> packed tensors -> model forward -> logits of the sampled rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, SeqRows
from kvserve.attention.forward_context import ForwardContext, forward_context
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.models.fused_llama import FusedLlamaForward
from kvserve.models.hf_adapter import PoolCache
from kvserve.scheduler.batch import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, num_tokens] int64
    position_ids: torch.Tensor  # [1, num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the packed batch whose logits are needed


class ModelRunner:
    def __init__(
        self,
        model: Any,
        layers: list[LayerKV],
        backend: AttentionBackend,
        device: torch.device,
        fused: FusedLlamaForward | None = None,
    ):
        self.model = model
        self.fused = fused  # the decoder forward when set; else HF's modeling code (the reference)
        self.decoder = model.model
        self.lm_head = model.get_output_embeddings()
        self.layers = layers
        self.backend = backend
        self.device = device
        self.block_size = layers[0].block_size
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """A step's token ids, positions, metadata (AttentionMetadata.build) and sampled rows."""
        input_ids: list[int] = []
        rows: list[SeqRows] = []
        logits_indices: list[int] = []
        for item in batch.items:
            seq, start = item.seq, item.seq.kv.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            rows.append(SeqRows(seq.kv.block_ids, torch.arange(start, end), end))
            if item.sample:
                logits_indices.append(len(input_ids) - 1)
        dev = self.device
        meta = AttentionMetadata.build(rows, self.block_size, dev)
        positions = torch.cat([r.positions for r in rows])
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
            position_ids=positions.unsqueeze(0).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Runs the step; returns float32 logits [num_sampled, vocab] in batch order of sampled items."""
        inputs = self.prepare_inputs(batch)
        if self.fused is not None:
            hidden = self.fused(
                inputs.input_ids[0], inputs.position_ids[0], self.layers, self.backend, inputs.meta
            )  # [num_tokens, hidden]
        else:
            with forward_context(ForwardContext(self.layers, self.backend, inputs.meta)):
                hidden = self.decoder(
                    input_ids=inputs.input_ids,
                    position_ids=inputs.position_ids,
                    past_key_values=PoolCache(),
                    use_cache=True,
                ).last_hidden_state[0]  # [num_tokens, hidden]
        hidden = hidden.index_select(0, inputs.logits_indices)
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

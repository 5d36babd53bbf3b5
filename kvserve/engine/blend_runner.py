"""BlendRunner: prefill with content reuse (moved KV) and repair, as one forward of its own.

Position map of the prompt [0, n):
  [0, prefix_len)        exact prefix: shared blocks, never touched
  hit ranges             KV copied from the cache, K rotated by (new - old position)
  everything else        fresh: computed with the full preceding context (the last token always is)
Repair recomputes some reused tokens too (their fresh K/V overwrite the moved ones):
  none        nothing
  selective   the first R tokens of every run of reused pieces, the last `overlap` tokens before each
              run, and the first `sink` prompt tokens
  cacheblend  every reused token in layers [0, check_layer]; from check_layer + 1 on only the
              `ratio` fraction whose fresh K deviated most from the moved K at the check layer
Query rows sit at arbitrary positions, so attention runs through PositionalBackend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.base import AttentionMetadata, SeqRows
from kvserve.attention.forward_context import ForwardContext, forward_context
from kvserve.attention.positional import PositionalBackend
from kvserve.kvcache.block_pool import slot_mapping
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.rope import RopeRotator
from kvserve.models.hf_adapter import PoolCache
from kvserve.scheduler.batch import BlendPlan


@dataclass
class BlendReport:
    num_reused_tokens: int  # moved from the cache
    num_recomputed_tokens: int  # of those, recomputed in the last layer
    token_layers: list[int]  # tokens processed by each layer
    compute_fraction: float  # sum(token_layers) / (num_layers * prompt length): vs a full prefill


class BlendRunner:
    def __init__(self, model: Any, layers: list[LayerKV], rotator: RopeRotator, device: torch.device):
        self.decoder = model.model
        self.lm_head = model.get_output_embeddings()
        self.layers = layers
        self.rotator = rotator
        self.device = device
        self.backend = PositionalBackend()
        self.block_size = layers[0].block_size

    def _slots(self, block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return slot_mapping(block_ids, positions, self.block_size)

    def move_hits(self, plan: BlendPlan, block_ids: torch.Tensor) -> torch.Tensor:
        """Copy the hits' KV into the sequence's slots, K rotated; returns the reused positions."""
        src = torch.tensor(
            [s for h in plan.hits for s in h.hit.src_slots], dtype=torch.long, device=self.device
        )
        dst_pos = torch.cat([torch.arange(h.dst_start, h.dst_start + h.num_tokens) for h in plan.hits])
        delta = torch.cat([torch.full((h.num_tokens,), h.delta) for h in plan.hits])
        dst = self._slots(block_ids, dst_pos.to(self.device))
        moved = bool((delta != 0).any())
        rotation = self.rotator.rotation(delta, self.device) if moved else None  # float32 cos, sin
        for layer in self.layers:
            k, v = layer.read_slots(src)  # [T, H_kv, D] compute_dtype
            if rotation is not None:
                k = self.rotator.apply(k, rotation)  # rotated in float32, rounded once to compute_dtype
            layer.write(dst, k, v)
        return dst_pos

    def _repair_positions(self, plan: BlendPlan, reused: torch.Tensor) -> torch.Tensor:
        """Selective: reused positions to recompute (bool mask over the prompt)."""
        n = reused.numel()
        repair = torch.zeros(n, dtype=torch.bool)
        for start, end in plan.runs():
            repair[start : min(end, start + plan.recompute_tokens)] = True
            repair[max(0, start - plan.overlap_tokens) : start] = True
        repair[: plan.sink_tokens] = True
        return repair & reused

    @torch.inference_mode()
    def execute(self, plan: BlendPlan) -> tuple[torch.Tensor, BlendReport]:
        """Returns float32 logits [vocab] of the last prompt token and what was computed.

        The blocks past the prefix get their rows out of order (moved, then fresh and repaired):
        storage holds them (LayerKV.hold_exact) so that each ends up encoded from its final rows,
        and lets a layer's go once that layer's forward has written its last rows."""
        assembled = plan.seq.kv.block_ids[plan.prefix_len // self.block_size :]
        for kv in self.layers:
            kv.hold_exact(assembled)
        try:
            return self._execute(plan, assembled)
        finally:
            for kv in self.layers:
                kv.release_exact(assembled)

    def _execute(self, plan: BlendPlan, assembled: list[int]) -> tuple[torch.Tensor, BlendReport]:
        seq = plan.seq
        n = seq.num_prompt_tokens
        block_ids = torch.tensor(seq.kv.block_ids, dtype=torch.long, device=self.device)
        reused = torch.zeros(n, dtype=torch.bool)
        reused[self.move_hits(plan, block_ids)] = True
        fresh = torch.zeros(n, dtype=torch.bool)
        fresh[plan.prefix_len :] = True
        fresh &= ~reused
        assert fresh[n - 1], "the last prompt token must be computed"
        if plan.strategy == "selective":
            compute = fresh | self._repair_positions(plan, reused)
        elif plan.strategy == "cacheblend":
            compute = fresh | reused
        else:
            compute = fresh
        token_ids = torch.tensor(seq.token_ids[:n], dtype=torch.long, device=self.device)
        positions = compute.nonzero().squeeze(1).to(self.device)  # sorted; ends with n - 1
        hidden = self.decoder.embed_tokens(token_ids[positions].unsqueeze(0))  # [1, T, hidden]
        token_layers: list[int] = []
        stored_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        reused_pos = reused.nonzero().squeeze(1).to(self.device)
        for idx, layer in enumerate(self.decoder.layers):
            if plan.strategy == "cacheblend" and idx == plan.check_layer:
                stored_kv = self.layers[idx].read_slots(self._slots(block_ids, reused_pos))
            if plan.strategy == "cacheblend" and idx == plan.check_layer + 1 and stored_kv is not None:
                keep = self._blend_select(plan, block_ids, positions, reused_pos, stored_kv, fresh)
                hidden, positions = hidden[:, keep], positions[keep]
            hidden = self._run_layer(layer, hidden, positions, block_ids, n)
            self.layers[idx].release_exact(assembled)  # layer idx's rows are final
            token_layers.append(int(positions.numel()))
        hidden = self.decoder.norm(hidden[:, -1:])
        logits = self.lm_head(hidden)[0, -1].float()
        num_recomputed = int(reused[positions.cpu()].sum())
        fraction = sum(token_layers) / (len(token_layers) * n)
        return logits, BlendReport(int(reused.sum()), num_recomputed, token_layers, fraction)

    def _blend_select(
        self,
        plan: BlendPlan,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        reused_pos: torch.Tensor,
        stored_kv: tuple[torch.Tensor, torch.Tensor],
        fresh: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of `positions` to keep after the check layer: fresh tokens plus the reused tokens whose
        fresh K moved furthest from the stored K (squared distance summed over heads and dims).
        Ranking by K beat ranking by V and by both on SmolLM2 (docs/blend.md)."""
        fresh_k = self.layers[plan.check_layer].read_slots(self._slots(block_ids, reused_pos))[0]
        deviation = ((fresh_k.float() - stored_kv[0].float()) ** 2).sum(dim=(1, 2))  # [num_reused]
        num_keep = round(plan.recompute_ratio * reused_pos.numel())
        chosen = reused_pos[torch.topk(deviation, num_keep).indices] if num_keep else reused_pos[:0]
        keep_pos = torch.zeros(fresh.numel(), dtype=torch.bool, device=positions.device)
        keep_pos[fresh.nonzero().squeeze(1).to(positions.device)] = True
        keep_pos[chosen] = True
        return keep_pos[positions]

    def _run_layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_ids: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        meta = AttentionMetadata.build(
            [SeqRows(block_ids.tolist(), positions, n)], self.block_size, self.device, explicit_positions=True
        )
        position_ids = positions.unsqueeze(0)
        cos_sin = self.decoder.rotary_emb(hidden, position_ids=position_ids)
        with forward_context(ForwardContext(self.layers, self.backend, meta)):
            out = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                past_key_values=PoolCache(),
                use_cache=True,
                position_embeddings=cos_sin,
            )
        return out[0] if isinstance(out, tuple) else out

"""Repairer: the engine's part of a content-reuse repair (reuse/repair.py plans it).

The rows of a repair run in ordinary steps through the one model forward (ModelRunner), each at its
explicit position. Around them the engine:
  begin    before the first slice: copies the hits' KV into the sequence's blocks with K re-rotated
           from the old to the new positions, holds those blocks exact (their rows are written out
           of order, LayerKV.hold_exact), and for CacheBlend keeps the moved K at the check layer
  probe    query-aware repair, on each first-pass slice that holds the question's rows: an
           AttentionProbe the model runner measures at the first pass's last layer
  select   CacheBlend, when the first pass (every row through layers [0, check_layer]) is done: the
           reused tokens whose fresh K at the check layer moved furthest from the moved K; query-aware
           repair: selective's marks and the reused tokens the question attended to most
  finish   the last pass is done: releases the hold
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvserve.kvcache.block_pool import slot_mapping
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.rope import RopeRotator
from kvserve.reuse.probe import AttentionProbe
from kvserve.reuse.repair import Repair, query_positions, selective_positions

if TYPE_CHECKING:
    from kvserve.scheduler.sequence import Sequence


@dataclass
class RepairReport:
    num_reused_tokens: int  # moved from the cache
    num_recomputed_tokens: int  # of those, recomputed in the last layer
    token_layers: list[int]  # rows each layer computed over all passes
    compute_fraction: float  # sum(token_layers) / (num_layers * prompt length): vs a full prefill


class Repairer:
    def __init__(self, layers: list[LayerKV], rotator: RopeRotator, device: torch.device, kv: KVCacheManager):
        self.layers = layers
        self.kv = kv
        self.rotator = rotator
        self.device = device
        self.block_size = layers[0].block_size

    def _blocks(self, seq: Sequence) -> list[int]:
        """The sequence's blocks in position order (the one place the repairer reads them)."""
        return self.kv.block_ids(seq.request_id)

    def _slots(self, seq: Sequence, positions: list[int]) -> torch.Tensor:
        block_ids = torch.tensor(self._blocks(seq), dtype=torch.long)
        return slot_mapping(block_ids, torch.tensor(positions, dtype=torch.long), self.block_size).to(
            self.device
        )

    def _assembled(self, seq: Sequence, repair: Repair) -> list[int]:
        """The blocks past the exact prefix: their rows arrive out of order."""
        return self._blocks(seq)[repair.plan.prefix_len // self.block_size :]

    @torch.inference_mode()
    def begin(self, seq: Sequence, repair: Repair) -> int:
        """Copy the hits' KV in (K rotated by new - old position); returns the token-layers moved."""
        assert not repair.moved
        for kv in self.layers:
            kv.hold_exact(self._assembled(seq, repair))
        hits = repair.plan.hits
        src = torch.tensor([s for h in hits for s in h.hit.src_slots], dtype=torch.long, device=self.device)
        dst = self._slots(seq, [p for h in hits for p in range(h.dst_start, h.dst_start + h.num_tokens)])
        delta = torch.cat([torch.full((h.num_tokens,), h.delta) for h in hits])
        rotation = self.rotator.rotation(delta, self.device) if bool((delta != 0).any()) else None
        for kv in self.layers:
            k, v = kv.read_slots(src)  # [T, H_kv, D] compute_dtype
            if rotation is not None:
                k = self.rotator.apply(k, rotation)  # rotated in float32, rounded once to compute_dtype
            kv.write(dst, k, v)
        repair.moved = True
        if repair.plan.strategy == "cacheblend" and repair.passes[0].num_layers is not None:
            check = self.layers[repair.plan.check_layer]  # the first pass overwrites it: keep it
            repair.check_k = check.read_slots(self._slots(seq, repair.reused))[0]
        if repair.plan.strategy == "query":
            repair.query_mass = torch.zeros(repair.num_prompt_tokens, dtype=torch.float32, device=self.device)
        return int(dst.numel()) * len(self.layers)

    def probe(self, seq: Sequence, repair: Repair, positions: list[int]) -> AttentionProbe | None:
        """Query-aware repair: the probe of a first-pass slice's question rows (None: it has none)."""
        if not repair.probing:
            return None
        asked = set(query_positions(repair.reused, repair.fresh))
        rows = [i for i, p in enumerate(positions) if p in asked]
        if not rows:
            return None
        layers = repair.passes[0].num_layers
        assert layers is not None and repair.query_mass is not None  # made by `begin`
        n = max(positions[i] for i in rows) + 1
        return AttentionProbe(
            layer=layers - 1,
            rows=rows,
            positions=torch.tensor([positions[i] for i in rows], dtype=torch.long, device=self.device),
            context_slots=self._slots(seq, list(range(n))),
            mass=repair.query_mass[:n],  # a view: the probe adds into the repair's mass
        )

    @torch.inference_mode()
    def select(self, seq: Sequence, repair: Repair) -> None:
        """The first pass is done: the reused tokens the second pass recomputes through every layer."""
        if repair.plan.strategy == "query":
            self._select_by_query(repair)
        else:
            self._select_by_deviation(seq, repair)

    def _select_by_query(self, repair: Repair) -> None:
        """Query-aware: selective's marks (run starts, the tokens before runs, the sink), and `ratio`
        of the other reused tokens, those the question's rows put the most attention mass on."""
        assert repair.awaits_selection and repair.query_mass is not None
        marks = set(selective_positions(repair.plan, repair.reused))
        others = [p for p in repair.reused if p not in marks]
        num_keep = round(repair.plan.recompute_ratio * len(others))
        chosen: list[int] = []
        if num_keep and others:
            mass = repair.query_mass.cpu()[torch.tensor(others, dtype=torch.long)]
            chosen = [others[i] for i in torch.topk(mass, num_keep).indices.tolist()]
        repair.select(sorted(marks) + chosen)
        repair.query_mass = None

    def _select_by_deviation(self, seq: Sequence, repair: Repair) -> None:
        """CacheBlend: `ratio` of the reused tokens: with seam_tokens, first the first tokens of every
        run (seam-aware); the rest those whose fresh K at the check layer deviates most from the
        moved K (squared distance over heads and dims). Ranking by K beat ranking by V and by both
        on SmolLM2 (docs/blend.md)."""
        assert repair.awaits_selection and repair.check_k is not None
        plan = repair.plan
        fresh_k = self.layers[plan.check_layer].read_slots(self._slots(seq, repair.reused))[0]
        deviation = ((fresh_k.float() - repair.check_k.float()) ** 2).sum(dim=(1, 2))  # [num_reused]
        num_keep = round(plan.recompute_ratio * len(repair.reused))
        seam = repair.seam_positions()
        seams = [i for i, p in enumerate(repair.reused) if p in seam][:num_keep]
        deviation[seams] = float("inf")  # ranked first
        chosen = torch.topk(deviation, num_keep).indices.tolist() if num_keep else []
        repair.select([repair.reused[i] for i in chosen])
        repair.check_k = None

    def finish(self, seq: Sequence, repair: Repair) -> RepairReport:
        """The last pass is computed: release the hold and record on the sequence what it reused
        (the first repair's counts: a re-admission after preemption keeps them); what it computed."""
        assert repair.finished
        for kv in self.layers:
            kv.release_exact(self._assembled(seq, repair))
        layers = repair.token_layers
        fraction = sum(layers) / (len(layers) * repair.num_prompt_tokens)
        report = RepairReport(len(repair.reused), repair.num_recomputed, list(layers), fraction)
        assert seq.report is not None  # admitted
        seq.report = replace(
            seq.report, strategy=repair.plan.strategy, hit_keys=tuple(h.key for h in repair.plan.hits)
        )
        if seq.report.compute_fraction is None:  # the first repair's (a re-admitted one's is not reported)
            seq.report = replace(
                seq.report,
                num_approx_cached_tokens=report.num_reused_tokens - report.num_recomputed_tokens,
                num_recomputed_tokens=report.num_recomputed_tokens,
                compute_fraction=report.compute_fraction,
            )
        return report

"""ModelRunner: ScheduledBatch -> packed tensors -> model forward -> logits of the sampled rows, and
the prompt logprobs of the prefill rows that need them (engine/prompt_logprobs.py).

This is the one forward of the model: prefill slices, decode rows and content-reuse repair rows
(reuse/repair.py) run through it together. A repair row carries its own position; a batch with
such rows gives every row its explicit position (`AttentionMetadata.query_positions`; a prefill or
decode row at position p sees [0, p], as the bottom-right rule gives it) and runs attention through a
backend that takes them (cpu_paged with the extension; else PositionalBackend). A repair row may also
stop before the last layer (CacheBlend's first pass): such items are packed last, longest first, and
the forward drops their rows after their last layer (`LayerCut`), so the rows still running are
always a prefix of the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata, SeqRows
from kvserve.attention.forward_context import ForwardContext, forward_context
from kvserve.attention.positional import PositionalBackend
from kvserve.engine.prompt_logprobs import ROWS_PER_BLOCK, PromptRows, rows_to_score, score
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.layout import KVLayout
from kvserve.models.by_layer import forward_by_layer
from kvserve.models.cpu_linear import RowInvariantLinear
from kvserve.models.fused_llama import FusedLlamaForward, LayerCut, LayerTail
from kvserve.models.hf_adapter import PoolCache
from kvserve.models.nested import NestedLinear, RowPrecision
from kvserve.request import TokenLogprob
from kvserve.reuse import AttentionProbe, ProbingBackend, Work
from kvserve.scheduler.batch import ScheduledBatch, ScheduledSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, num_tokens] int64
    position_ids: torch.Tensor  # [1, num_tokens] int64
    meta: AttentionMetadata  # the first layer group's (the only one without sliding-window layers)
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the packed batch whose logits are needed
    cuts: list[LayerCut] = field(default_factory=list)  # rows that stop early, by layer
    work: Work = field(default_factory=Work)  # what the forward computes (reuse/cost.py)
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows that score prompt tokens
    precision: RowPrecision | None = None  # NestedFP weights: each row's precision (its sequence's)
    probes: list[AttentionProbe] = field(default_factory=list)  # attention measured beside the forward
    layer_metas: list[AttentionMetadata] | None = None  # per layer, its group's (None: one group)
    tail: LayerTail | None = None  # the fused forward's last layer: only the sampled rows (prepare_inputs)


class SampledRows:
    """The step's sampled rows: their logits on demand, or, where every row takes the plain argmax, only
    those tokens (`greedy_tokens`). A greedy step's LM head on AMX tiles then never writes the
    [rows, vocab] logits nor reads them back: the argmax is taken in the head's epilogue
    (`row_linear_bf16_argmax`, linear_amx.h Argmax), bitwise argmax_rows of these logits."""

    def __init__(self, runner: ModelRunner, hidden: torch.Tensor):
        self.runner, self.hidden = runner, hidden  # hidden [num_sampled, hidden]
        self._logits: torch.Tensor | None = None
        # called once with the seconds the head took, when it runs (StepExecute: the step's cost)
        self.on_head: Callable[[float], None] | None = None

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def logits(self) -> torch.Tensor:
        """[num_sampled, vocab] in batch order of the sampled items; float32 or the lm_head's bf16/fp16
        (a row's .float() is the float32 logits exactly)."""
        if self._logits is None:
            self._logits = self._head(lambda: self.runner._logits(self.hidden, float32=False))
        return self._logits

    def greedy_tokens(self) -> list[int] | None:
        """argmax_rows(self.logits()) as ids, from the head's fused argmax; None where the head has none
        (then the caller takes the logits)."""
        head_argmax = self.runner.head_argmax
        if head_argmax is None or self._logits is not None or not len(self):
            return None
        return self._head(lambda: head_argmax(self.hidden).tolist())

    def _head(self, run: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        with torch.inference_mode():  # as the forward that made hidden
            out = run()
        if self.on_head is not None:
            report, self.on_head = self.on_head, None
            report(time.perf_counter() - start)
        return out


@dataclass
class StepOutput:
    rows: SampledRows  # the sampled rows: their logits, or their greedy tokens
    # per PromptRows of the step: the prompt tokens those rows score, in position order
    prompt_logprobs: list[tuple[PromptRows, list[TokenLogprob]]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        layers: list[LayerKV],
        backend: AttentionBackend,
        device: torch.device,
        fused: FusedLlamaForward | None = None,
        vocab_size: int | None = None,
        layout: KVLayout | None = None,
    ):
        self.model = model
        self.fused = fused  # the decoder forward when set; else HF's modeling code (the reference)
        self.decoder = model.model
        self.lm_head = model.get_output_embeddings()
        self.layers = layers
        self.backend = backend
        self.positional = PositionalBackend()
        self.device = device
        self.block_size = layers[0].block_size
        self.num_layers = len(layers)
        self.layout = layout if layout is not None else KVLayout.single(len(layers))
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        # the tokenizer's ids (RuntimeInfo.vocab_size): an lm_head may have more rows (padding, or a
        # random-weight model's full vocabulary), which nothing may sample or count in a logprob
        self.vocab_size = vocab_size
        self._positions = torch.arange(4096)  # _arange

    def _rows(self, item: ScheduledSeq) -> tuple[list[int], SeqRows]:
        seq = item.seq
        table = _readable(item.block_tables[0])
        if item.positions is not None:
            positions = torch.tensor(item.positions, dtype=torch.long)
            return [seq.token_ids[p] for p in item.positions], SeqRows(
                table, positions, item.positions[-1] + 1
            )
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        return seq.token_ids[start:end], SeqRows(table, self._arange(end)[start:end], end)

    def _arange(self, end: int) -> torch.Tensor:
        """0, 1, ... (int64, at least `end` of them), made once: a slice of it is a row range's positions."""
        if len(self._positions) < end:
            self._positions = torch.arange(max(end, 2 * len(self._positions), 4096))
        return self._positions

    def _layer_metas(
        self, items: list[ScheduledSeq], rows: list[SeqRows], meta: AttentionMetadata, explicit: bool
    ) -> list[AttentionMetadata] | None:
        """Each layer's metadata when the layout has more than one layer group: the same rows, each
        group's block tables and slots."""
        layout = self.layout
        if layout.num_groups == 1:
            return None
        metas = [meta] + [
            AttentionMetadata.build(
                [
                    SeqRows(_readable(it.block_tables[g]), r.positions, r.seq_len)
                    for it, r in zip(items, rows, strict=True)
                ],
                self.block_size,
                self.device,
                explicit_positions=explicit,
            )
            for g in range(1, layout.num_groups)
        ]
        return layout.per_layer(metas)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """A step's token ids, positions, metadata (AttentionMetadata.build), sampled rows and cuts.
        Items that stop early go last, longest first; the others keep their order (and so the
        order of the sampled rows)."""
        layers = self.num_layers
        if self._plain_decode(batch.items):
            return self._decode_inputs(batch.items)
        items = sorted(batch.items, key=lambda it: -(it.num_layers or layers))
        explicit = any(it.positions is not None for it in items)
        input_ids: list[int] = []
        rows: list[SeqRows] = []
        logits_indices: list[int] = []
        prompt_rows: list[PromptRows] = []
        row_precisions: list[str] = []
        work = Work()
        probes = []
        for item in items:
            ids, r = self._rows(item)
            if item.probe is not None:
                item.probe.first_row = len(input_ids)
                probes.append(item.probe)
            if item.positions is None:  # prefill rows [start, seq_len); they run every layer
                start = r.seq_len - len(ids)
                scored = rows_to_score(item.seq, start, r.seq_len)
                if scored is not None:
                    lo, hi = scored
                    prompt_rows.append(PromptRows(item.seq, len(input_ids) + lo - start, lo, hi - lo))
            input_ids += ids
            rows.append(r)
            if item.precision is not None:
                row_precisions += [item.precision] * len(ids)
            num_layers = item.num_layers or layers
            if item.positions is None:
                work.add_span(r.seq_len - len(ids), r.seq_len, num_layers)
            else:
                work.add_rows(float(sum(item.positions)), len(ids), num_layers)
            if item.sample:
                assert num_layers == layers, "a row that stops early is never sampled"
                logits_indices.append(len(input_ids) - 1)
        dev = self.device
        positions = torch.cat([r.positions for r in rows])
        meta = AttentionMetadata.build(
            rows, self.block_size, dev, explicit_positions=explicit, positions=positions
        )
        layer_metas = self._layer_metas(items, rows, meta, explicit)
        cuts = []
        assert layer_metas is None or all(it.num_layers is None for it in items), "layer groups take no cuts"
        for k in sorted({it.num_layers for it in items if it.num_layers is not None}, reverse=True):
            keep = [r for it, r in zip(items, rows, strict=True) if (it.num_layers or layers) > k]
            sub = AttentionMetadata.build(keep, self.block_size, dev, explicit_positions=explicit)
            cuts.append(LayerCut(k - 1, sum(len(r.positions) for r in keep), sub))
        tail = None
        if self._takes_tail(items, logits_indices, len(input_ids), cuts, prompt_rows, probes, row_precisions):
            # only the sampled rows (each its sequence's last) past the last layer's KV write
            last = [
                SeqRows(r.block_ids, r.positions[-1:], r.seq_len)
                for it, r in zip(items, rows, strict=True)
                if it.sample
            ]
            tail = LayerTail(
                torch.tensor(logits_indices, dtype=torch.long, device=dev),
                AttentionMetadata.build(last, self.block_size, dev, write=False),
            )
            logits_indices = list(range(len(logits_indices)))
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
            position_ids=positions.unsqueeze(0).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            tail=tail,
            cuts=cuts,
            work=work,
            prompt_rows=prompt_rows,
            precision=RowPrecision.of(row_precisions) if row_precisions else None,
            probes=probes,
            layer_metas=layer_metas,
        )

    def _plain_decode(self, items: list[ScheduledSeq]) -> bool:
        """Whether every item is one sampled row at the end of its sequence's KV, through every layer,
        with one layer group, and no prompt logprobs, probe or per-row precision (the common decode
        step; the general path would make the same inputs, tests/integration/test_decode_inputs.py)."""
        return self.layout.num_groups == 1 and all(
            it.num_new_tokens == 1
            and it.sample
            and it.positions is None
            and it.num_layers is None
            and it.probe is None
            and it.precision is None
            and not it.seq.wants_prompt_logits
            for it in items
        )

    def _decode_inputs(self, items: list[ScheduledSeq]) -> StepInputs:
        """prepare_inputs of a plain decode step (`_plain_decode`): the same inputs from lists of the
        items' tokens, positions and tables (AttentionMetadata.decode), no per-sequence tensors."""
        positions = [it.seq.num_computed_tokens for it in items]
        input_ids = [it.seq.token_ids[p] for it, p in zip(items, positions, strict=True)]
        tables = [_readable(it.block_tables[0]) for it in items]
        dev = self.device
        work = Work()
        work.add_rows(float(sum(positions)), len(items), self.num_layers)
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            meta=AttentionMetadata.decode(tables, positions, self.block_size, dev),
            logits_indices=self._arange(len(items))[: len(items)].to(dev),
            work=work,
        )

    def _takes_tail(
        self,
        items: list[Any],
        logits_indices: list[int],
        num_rows: int,
        cuts: list[LayerCut],
        prompt_rows: list[PromptRows],
        probes: list[Any],
        row_precisions: list[str],
    ) -> bool:
        """The fused forward's last layer may skip rows whose hidden state nobody reads: when the only
        rows that leave the model are the sampled ones (no prompt logprobs, probes, early cuts or
        per-row NestedFP precisions), each its sequence's last row, and they are fewer than all."""
        if self.fused is None or cuts or prompt_rows or probes or row_precisions:
            return False
        if len(logits_indices) == num_rows:  # decode: every row is sampled
            return False
        return all(it.positions is None for it in items)  # bottom-right rows: a sampled row ends its sequence

    def backend_for(self, meta: AttentionMetadata) -> AttentionBackend:
        """Rows at explicit positions need a backend that takes them."""
        if meta.query_positions is None or self.backend.handles_positions(self.layers[0].head_dim):
            return self.backend
        return self.positional

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, inputs: StepInputs | None = None) -> StepOutput:
        """Runs the step: the logits of the sampled rows (the lm_head's dtype) and the prompt logprobs
        of `prompt_rows`."""
        inputs = inputs if inputs is not None else self.prepare_inputs(batch)
        backend = self.backend_for(inputs.meta)
        if inputs.probes:
            backend = ProbingBackend(backend, self.layers, inputs.probes)
        if self.fused is not None:
            hidden = self.fused(
                inputs.input_ids[0],
                inputs.position_ids[0],
                self.layers,
                backend,
                inputs.meta,
                inputs.cuts,
                inputs.precision,
                inputs.tail,
            )  # [num_tokens left after the cuts, or the tail's rows, hidden]
        elif inputs.cuts:  # only models approximate reuse supports have cuts (reuse/build.py)
            ctx = ForwardContext(self.layers, backend, inputs.meta)
            hidden = forward_by_layer(self.decoder, inputs.input_ids, inputs.position_ids, inputs.cuts, ctx)
        else:
            with forward_context(ForwardContext(self.layers, backend, inputs.meta, inputs.layer_metas)):
                hidden = self.decoder(
                    input_ids=inputs.input_ids,
                    position_ids=inputs.position_ids,
                    past_key_values=PoolCache(),
                    use_cache=True,
                ).last_hidden_state[0]  # [num_tokens, hidden]
        prompt_logprobs = [(rows, self._score(hidden, rows)) for rows in inputs.prompt_rows]
        return StepOutput(SampledRows(self, hidden.index_select(0, inputs.logits_indices)), prompt_logprobs)

    @property
    def head_argmax(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """hidden [rows, hidden] -> argmax_rows of their logits, without the logits: a bf16 LM head on AMX
        tiles (RowInvariantLinear.argmax) and no softcap (its tanh could tie what it rounds); else None."""
        head = self.lm_head
        if self.softcap or not isinstance(head, RowInvariantLinear) or not head.has_argmax():
            return None
        limit = self.vocab_size if self.vocab_size is not None else head.out_features
        return lambda hidden: head.argmax(hidden, min(limit, head.out_features))

    def _logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [rows, hidden] -> logits [rows, vocab], only the tokenizer's ids (vocab_size) where
        the lm_head has more rows: float32, or with float32=False in the lm_head's own dtype (bf16 on a
        bf16 model; the same numbers, as converting is exact: the step's sampler takes the argmax of
        bf16 rows as they are and converts only the rows it changes, saving a [128, 49152] float32
        copy of 1-2.5 ms on a 2-core Xeon).
        A NestedFP LM head computes in FP16
        mode at every precision: in FP8 it carried most of FP8 mode's perplexity cost on SmolLM2 (+6.0 %
        with it, +1.6 % without; docs/weights.md), for 28 MB more read a step (162 MB instead of 134)."""
        if isinstance(self.lm_head, NestedLinear):
            logits = self.lm_head.run(hidden.contiguous(), RowPrecision("fp16"))
        else:
            logits = self.lm_head(hidden)
            if float32 or self.softcap:
                logits = logits.float()
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _score(self, hidden: torch.Tensor, rows: PromptRows) -> list[TokenLogprob]:
        """The prompt logprobs of `rows`, ROWS_PER_BLOCK rows of logits at a time."""
        k = rows.seq.request.sampling_params.prompt_logprobs
        assert k is not None
        targets = rows.target_ids
        entries: list[TokenLogprob] = []
        for start in range(0, rows.num_rows, ROWS_PER_BLOCK):
            end = min(start + ROWS_PER_BLOCK, rows.num_rows)
            block = hidden[rows.first_row + start : rows.first_row + end]
            entries += score(self._logits(block), targets[start:end], k)
        return entries


def _readable(table: list[int]) -> list[int]:
    """A block table as kernels read it: a block that left a sliding window (-1) becomes block 0,
    whose values the window masks (every kernel skips or masks positions before a row's window)."""
    return table if not table or min(table) >= 0 else [max(b, 0) for b in table]

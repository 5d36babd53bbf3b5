"""A model's weights as NestedFP (kvserve/quant/nestedfp.py): every nn.Linear and the input embedding
held once as two byte planes, computed in FP16 mode (both planes, exact) or FP8 mode (the upper plane
alone) per row of a step.

`nest_model` replaces, in place:
- every nn.Linear (the LM head included) with a `NestedLinear`: its weight packed for the CPU
  extension's `nested_linear` (csrc/cpu/nested_linear.cpp) with one power-of-two scale per output
  channel; the fp32 weight is dropped;
- the input embedding with a `NestedEmbedding` that reads its rows out of the same planes. With tied
  embeddings (SmolLM2) the LM head's planes are the table, so it is stored once. Rows are looked up
  at FP16 precision in both modes: a lookup reads a few rows, so the exact ones cost nothing.

So a model's weights take 2 bytes a parameter (plus a scale an output row and the fp32 norms and
biases), and FP8 mode reads 1 byte a weight of the decoder's projections (the engine keeps the LM head
in FP16 mode: engine/model_runner.py). Activations and accumulation stay fp32.

Which rows compute in which mode is a `RowPrecision`. The engine runs a step at one precision
(engine/precision.py), so a step's rows normally share it; a request pinned to a precision (an audit
recomputing what was served) can differ, and then each projection runs once per precision over its
rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kvserve.quant.nestedfp import NestedWeight


@dataclass(frozen=True)
class RowPrecision:
    """The precision of each row of a step: `fp8` a bool [rows] mask (True: FP8 mode), or None when
    every row computes in `uniform`."""

    uniform: str | None = "fp16"
    fp8: torch.Tensor | None = None

    @classmethod
    def of(cls, precisions: list[str]) -> RowPrecision:
        """From one precision a row ('fp16' or 'fp8')."""
        kinds = set(precisions)
        if len(kinds) <= 1:
            return cls(next(iter(kinds), "fp16"))
        return cls(None, torch.tensor([p == "fp8" for p in precisions]))

    def head(self, rows: int) -> RowPrecision:
        """The first `rows` rows (what goes on after a cut)."""
        return self if self.fp8 is None else RowPrecision.of_mask(self.fp8[:rows])

    @classmethod
    def of_mask(cls, fp8: torch.Tensor) -> RowPrecision:
        if bool(fp8.all()):
            return cls("fp8")
        if not bool(fp8.any()):
            return cls("fp16")
        return cls(None, fp8)

    def groups(self) -> list[tuple[bool, torch.Tensor]]:
        """(fp16 mode, the rows' indices) for each precision present (mixed steps only)."""
        assert self.fp8 is not None
        return [(False, self.fp8.nonzero().flatten()), (True, (~self.fp8).nonzero().flatten())]


class NestedLinear(nn.Module):
    """y = x W^T (+ b) over NestedFP planes, fp32 x and y. Several of these concatenate into one call
    (`concat`) like the dense projections do (models/fused_llama.py)."""

    def __init__(
        self,
        packed: torch.Tensor,  # uint8 [2, panels, in, lanes] (ext.pack_nested_weight)
        scale: torch.Tensor,  # fp32 [out]
        bias: torch.Tensor | None,  # fp32 [out]
        out_features: int,
        ext: ModuleType,
    ):
        super().__init__()
        self.packed, self.scale, self.bias, self.ext = packed, scale, bias, ext
        self.in_features, self.out_features = int(packed.shape[2]), out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear, ext: ModuleType) -> NestedLinear:
        return cls.from_weight(linear.weight.detach(), linear.bias, ext)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, ext: ModuleType) -> NestedLinear:
        nested = NestedWeight.from_float(weight)
        packed = ext.pack_nested_weight(nested.hi, nested.lo)
        b = bias.detach().float().clone() if bias is not None else None
        return cls(packed, nested.scale, b, weight.shape[0], ext)

    @property
    def panel_width(self) -> int:
        return int(self.packed.shape[-1])

    def run(self, x: torch.Tensor, precision: RowPrecision) -> torch.Tensor:
        """x [rows, in] fp32 contiguous -> [rows, out] fp32, each row in its precision."""
        ext = self.ext
        if precision.fp8 is None:
            fp16 = precision.uniform == "fp16"
            return ext.nested_linear(x, self.packed, self.scale, self.bias, self.out_features, fp16)
        y = x.new_empty(x.shape[0], self.out_features)
        for fp16, rows in precision.groups():
            part = x.index_select(0, rows)
            y.index_copy_(
                0, rows, ext.nested_linear(part, self.packed, self.scale, self.bias, self.out_features, fp16)
            )
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A plain call (Hugging Face's modeling code: the RoPE self-check) computes in FP16 mode."""
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = self.run(rows, RowPrecision("fp16"))
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def concat(linears: list[NestedLinear]) -> NestedLinear:
    """One NestedLinear computing several of the same input, outputs side by side. Each must have whole
    panels (out_features a multiple of the panel width); the modules' planes become views of the
    concatenation, so memory does not grow."""
    first = linears[0]
    if len(linears) == 1:
        return first
    lanes = first.panel_width
    if any(m.out_features % lanes for m in linears):
        raise ValueError(f"out_features {[m.out_features for m in linears]} are not multiples of {lanes}")
    packed = torch.cat([m.packed for m in linears], dim=1)
    start = 0
    for m in linears:
        panels = m.packed.shape[1]
        m.packed = packed[:, start : start + panels]
        start += panels
    scale = torch.cat([m.scale for m in linears])
    biases = [m.bias for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, linears)]
        )
    return NestedLinear(packed, scale, bias, sum(m.out_features for m in linears), first.ext)


class NestedEmbedding(nn.Module):
    """An embedding table read out of a NestedLinear's planes (row i = output channel i), at FP16
    precision: fp32 rows, bitwise the FP16 weights times their channel scale."""

    def __init__(self, table: NestedLinear, padding_idx: int | None = None):
        super().__init__()
        self.table = table
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        lanes = self.table.panel_width
        planes = self.table.packed[:, flat // lanes, :, flat % lanes]  # [n, 2, in]
        hi = planes[:, 0].view(torch.int8).to(torch.int16)
        residual = planes[:, 1].view(torch.int8).to(torch.int16)
        # as the kernel does: the E4M3 byte << 7 under the FP16 sign (bit 14 cleared), plus the residual
        bits = ((hi << 7) & -0x4001) + residual
        rows = bits.view(torch.float16).float() * self.table.scale.index_select(0, flat).unsqueeze(1)
        return rows.view(*ids.shape, self.embedding_dim)


def nest_model(model: nn.Module, ext: ModuleType) -> int:
    """Replace the model's linears and input embedding in place (see the module docstring); returns
    how many linears. Ties are kept: a tied LM head and embedding share one set of planes."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        nested = NestedLinear.from_linear(linear, ext)
        setattr(parent, child, nested)
        if tied and linear is head:
            model.set_input_embeddings(NestedEmbedding(nested, embed.padding_idx))
    if not tied and embed is not None:
        table = NestedLinear.from_weight(embed.weight.detach(), None, ext)
        model.set_input_embeddings(NestedEmbedding(table, embed.padding_idx))
    return len(targets)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the model's weights take, parameters they stand for). Every tensor is counted once however
    many modules share it (tied tables, concatenated projections): the parameters, the NestedFP planes
    and scales, and the dense linears' packed copies (models/cpu_linear.py keeps the parameter too)."""
    seen: set[int] = set()
    total = params = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.untyped_storage().data_ptr() in seen:
            return
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()

    for m in model.modules():
        if isinstance(m, NestedLinear):
            params += m.out_features * m.in_features + (m.bias.numel() if m.bias is not None else 0)
            for t in (m.packed, m.scale, m.bias):
                add(t)
        else:
            add(getattr(m, "packed", None))
    for p in model.parameters():
        if p.untyped_storage().data_ptr() not in seen:
            params += p.numel()
        add(p)
    return total, params

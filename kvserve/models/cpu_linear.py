"""nn.Linear for fp32 and bf16 models on CPU through the CPU extension's `row_linear` / `row_linear_bf16`
(csrc/cpu/linear_cpu.cpp), for every row count.

Why not torch: its CPU GEMM picks a different summation order depending on the number of rows (on the
dev machine a row's fp32 result differed between 1 and 4+ rows), so a token's projections depended on
what else was in the step: a decode row next to another sequence's prefill, the last prompt token
recomputed alone on a full prefix hit, or a prompt split differently into prefill slices. Through
`row_linear` every output element is one fixed sum whatever the row count, the tiling and the thread
count (batch invariance; docs/kernels.md has the guarantee and what it cost).

The kernel reads the weight packed into panels of output features (`pack_linear_weight`, done once
here): a second copy of every wrapped weight, the price of a GEMM with no horizontal sums (about
540 MB more for SmolLM2-135M in fp32; the parameters themselves are kept, so a tied lm_head stays tied
to the embedding and the module stays an ordinary Linear to anything that reads `.weight`). In bf16 the
copy is half that, and the kernel sums each output in fp32 over pairs of inputs (AVX-512 BF16's
`vdpbf16ps` where the CPU has it), rounding once to bf16 at the end.

An fp32 model converted from a GGUF keeps its weights' GGUF codes beside them (models/gguf_codes.py:
int8 codes with a per-group scale and offset that give the converted fp32 weight bit for bit). Its
linears then run `row_linear_qcodes` (csrc/cpu/linear_qcodes.cpp) over those, packed at their own width
(models/code_layout.py: 4-6 bits where the codes fit, compact factors): the same chains over the same
fp32 weights, so the same outputs bitwise, from 0.6-1.07 bytes a weight instead of 4. A decode step
reads the codes in place; a prefill widens each block of them to fp32 once. Nothing fp32 is packed
then: the packed copy is the codes. Weights that run as one call (q|k|v, gate|up: the fused forward)
share one layout. AVX2 builds keep the int8 codes (`row_linear_codes`, csrc/cpu/linear_codes.cpp: 1.25
bytes a weight at group 32, 1.5 at 16), whose widening is cheaper there (packed_codes_pay). A tied LM head reads the embedding's codes where they are its weight.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from kvserve.models.code_layout import CodeLayout, choose_layout, pack
from kvserve.models.gguf_codes import Codes, dequantize, regroup

log = logging.getLogger("kvserve.models")


class RowInvariantLinear(nn.Module):
    """Wraps an nn.Linear (same parameters; the weight packed once for the kernel). Pack again with
    `repack()` after changing the weight in place (with codes: it raises unless they are still the weight).
    `codes` must be the weight's bit for bit: wrap_linears checks."""

    def __init__(
        self, linear: nn.Linear, ext: ModuleType, codes: Codes | None = None, layout: CodeLayout | None = None
    ):
        super().__init__()
        self.linear, self.ext = linear, ext
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.codes = codes  # an fp32 weight's GGUF codes, checked to be it bit for bit (wrap_linears)
        self.layout = layout  # with codes: packed at their width (row_linear_qcodes); None: int8 codes
        self.glu_kernel = ext.row_linear_glu  # the gated MLP's call over this pack (with its up's)
        self.packed = self._pack(check=False)

    def repack(self) -> torch.Tensor:
        return self._pack(check=True)

    @torch.no_grad()
    def _pack(self, check: bool) -> torch.Tensor:
        weight = self.linear.weight.detach()
        self.dtype = weight.dtype
        if self.codes is not None:
            if self.dtype != torch.float32 or (check and not same_bits(dequantize(self.codes), weight)):
                raise ValueError(
                    "the codes are not this fp32 weight (changed in place? wrap it without codes)"
                )
            if self.layout is None:  # int8 codes, fp32 factors (row_linear_codes)
                c = self.codes
                self.kernel, self.glu_kernel = self.ext.row_linear_codes, self.ext.row_linear_glu
                self.packed = self.ext.pack_linear_codes(c.codes, c.scale, c.offset)  # uint8 [panels, bytes]
            else:
                self.kernel, self.glu_kernel = self.ext.row_linear_qcodes, self.ext.row_linear_glu_qcodes
                self.packed = pack(self.ext, self.codes, self.layout)  # uint8 [panels, row bytes]
            self.lanes = self.ext.linear_lanes()
            return self.packed
        bf16 = self.dtype == torch.bfloat16
        pack_weight = self.ext.pack_linear_weight_bf16 if bf16 else self.ext.pack_linear_weight
        self.kernel = self.ext.row_linear_bf16 if bf16 else self.ext.row_linear  # reads what pack wrote
        self.packed = pack_weight(weight)  # fp32 [panels, in, lanes]; bf16 [panels, in / 2, lanes * 2]
        self.lanes = self.packed.shape[-1] // (2 if bf16 else 1)  # output features per panel
        return self.packed

    def has_argmax(self) -> bool:
        """Whether `argmax` runs here: a bf16 weight of its own packing (no codes) on AMX tiles."""
        return (
            self.dtype == torch.bfloat16
            and self.codes is None
            and bool(self.ext.linear_amx(self.in_features))
        )

    def argmax(self, x: torch.Tensor, limit: int) -> torch.Tensor:
        """argmax_rows(self(x)[:, :limit]) as int64 [rows], bitwise, without the [rows, out] outputs
        (row_linear_bf16_argmax: the argmax in the AMX kernel's epilogue). Only where has_argmax()."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return self.ext.row_linear_bf16_argmax(rows, self.packed, self.linear.bias, self.out_features, limit)

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu":
            return self.linear(x)  # not what wrap_linears wraps; kept correct, not invariant
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = self.kernel(rows, self.packed, self.linear.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


WRAPPED_DTYPES = (torch.float32, torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def wrap_linears(model: nn.Module, ext: ModuleType, codes: dict[str, Codes] | None = None) -> int:
    """Wraps every fp32 or bf16 CPU nn.Linear of `model` in place; returns how many. `codes` (module
    name -> GGUF codes, models/gguf_codes.py load_codes) puts fp32 linears on the codes kernel: every
    decoder projection or none (the fused forward concatenates them), the LM head on its own (a tied
    head on the embedding's codes), and only where the codes are the weight bit for bit. Projections
    that run as one call (fusion_key) share one layout."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype in WRAPPED_DTYPES
        and module.weight.device.type == "cpu"
    ]
    usable = _usable_codes(targets, _with_tied_head(model, codes or {}))
    packed = packed_codes_pay(ext)
    layouts = _layouts(usable) if packed else {}
    if not packed:  # int8 codes: one group per call (the fused ones concatenate rows of one length)
        usable = {name: regroup(c, _fused_group(usable, name)) for name, c in usable.items()}
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RowInvariantLinear(linear, ext, usable.get(name), layouts.get(name)))
    if usable:
        counts: dict[str, int] = {}
        for desc in (
            (layout.describe() for layout in layouts.values())
            if packed
            else (f"int8 codes, fp32 factors, group {c.group}" for c in usable.values())
        ):
            counts[desc] = counts.get(desc, 0) + 1
        log.info(
            "GGUF codes: %d of %d linears read their codes (%s): %s",
            len(usable),
            len(targets),
            "row_linear_qcodes, packed at their width" if packed else "row_linear_codes, int8: an AVX2 build",
            "; ".join(f"{n} x {d}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1])),
        )
    return len(targets)


def packed_codes_pay(ext: ModuleType) -> bool:
    """Whether codes are packed at their width (row_linear_qcodes) rather than as int8 (row_linear_codes):
    on AVX-512 builds. On AVX2 (no permute table, no lane masks) widening the packed bits cost more than
    the bytes saved: a pass over Qwen2.5-0.5B's linears ran 0.79x (1 row) and 0.83x (8 rows) the int8
    codes' speed there (docs/kernels.md, Packed codes)."""
    return bool(ext.linear_lanes() == 16)


def _fused_group(codes: dict[str, Codes], name: str) -> int:
    key = fusion_key(name)
    return min(c.group for n, c in codes.items() if fusion_key(n) == key)


def fusion_key(name: str) -> str:
    """Linears with one key run as one call in the fused forward (q|k|v, gate|up) and share a layout."""
    parent, _, child = name.rpartition(".")
    if child in ("q_proj", "k_proj", "v_proj"):
        return parent + ".qkv"
    if child in ("gate_proj", "up_proj"):
        return parent + ".gate_up"
    return name


def _layouts(codes: dict[str, Codes]) -> dict[str, CodeLayout]:
    groups: dict[str, list[str]] = {}
    for name in codes:
        groups.setdefault(fusion_key(name), []).append(name)
    layouts = {}
    for names in groups.values():
        layout = choose_layout([codes[n] for n in names])
        layouts.update(dict.fromkeys(names, layout))
    return layouts


def _with_tied_head(model: nn.Module, codes: dict[str, Codes]) -> dict[str, Codes]:
    """codes, with the LM head's taken from the embedding's where the head is tied to it and has none."""
    head, embed = (
        getattr(model, "lm_head", None),
        getattr(getattr(model, "model", None), "embed_tokens", None),
    )
    if "lm_head" in codes or head is None or embed is None or "model.embed_tokens" not in codes:
        return codes
    if head.weight is not embed.weight:
        return codes
    return {**codes, "lm_head": codes["model.embed_tokens"]}


def _usable_codes(targets: list[tuple[str, nn.Linear]], codes: dict[str, Codes]) -> dict[str, Codes]:
    if not codes:
        return {}
    exact = {}
    for name, linear in targets:
        c = codes.get(name)
        if c is not None and linear.weight.dtype == torch.float32 and same_bits(dequantize(c), linear.weight):
            exact[name] = c
    projections = [name for name, _ in targets if not name.endswith("lm_head")]
    missing = [name for name in projections if name not in exact]
    if missing:  # the fused forward needs one kernel for q|k|v and gate|up
        log.warning(
            "GGUF codes unused for the decoder's projections: none (or not the weight) for %d of "
            "them, e.g. %s",
            len(missing),
            missing[0],
        )
        exact = {name: c for name, c in exact.items() if name.endswith("lm_head")}
    return exact

"""The Llama-family decoder forward on CPU in a few extension calls per layer, instead of Hugging Face's
eager modeling code.

Why: a small model's decode step on CPU is mostly per-op dispatch. SmolLM2-135M's HF forward issues
about 50 torch ops per layer; at batch 8 on the dev machine (bf16), 19 ms of a 45 ms step went to them
rather than to GEMMs or attention (scripts/profile_step.py). Here a layer is nine calls:

    add_rms_norm_ -> row_linear(q|k|v) -> rope_ -> KV write -> attention -> row_linear(o)
    -> add_rms_norm_ -> row_linear_glu(gate|up: silu(gate) * up) -> row_linear(down)

What it computes is the HF forward's arithmetic, checked against it (tests/kernels/test_fused_llama.py):
- The projections are the same `row_linear` chains as the wrapped HF modules. q, k and v (and gate and
  up) are one call over their packed weights concatenated: every output element is its own fixed chain,
  so the fused call is bitwise the separate ones. The concatenation shares memory with the HF modules'
  packs (they become views into it), so nothing is stored twice.
- Rotary embedding and the residual adds are bitwise torch's elementwise ops (csrc/cpu/layer_ops.cpp);
  cos / sin come from the model's own rotary module (so any RoPE scaling it implements applies),
  tabulated once per position range (`RopeTable`).
- silu(gate) * up rounds where torch's ops of the dtype round (bf16: the SiLU, then the product), with
  an exp of its own (csrc/cpu/vec.h), so it agrees with torch's to about an fp32 ulp before rounding.
- RMSNorm sums squares in an order of its own, so hidden states agree with HF's to rounding (fp32
  logits within 1e-4 of HF's on SmolLM2, 7e-5 the largest seen), not bitwise. Every row's arithmetic
  is fixed whatever the other rows, so batch invariance and cache-on == cache-off hold exactly, as
  tested for the engine.

With NestedFP weights (`--weight-precision`, models/nested.py) the projections and the LM head are
NestedLinear calls, each row at its request's precision (`RowPrecision`); the rest is the same.

The HF model stays loaded and is the reference: `--model-forward hf` serves through it, and models
this module does not cover (see `unsupported_reason`) always use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.models.cpu_linear import RowInvariantLinear
from kvserve.models.hf_adapter import sliding_window
from kvserve.models.nested import NestedLinear, RowPrecision, concat

MODEL_TYPES = ("llama", "mistral", "qwen2")  # RMSNorm, SiLU gated MLP, RoPE, no q/k norms or softcaps


@dataclass
class FusedLinear:
    """One row_linear call over several RowInvariantLinears' packed weights, concatenated by output."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    kernel: Callable[..., torch.Tensor]  # ext.row_linear, row_linear_bf16 or row_linear_qcodes
    glu_kernel: Callable[..., torch.Tensor]  # the gated MLP's over gate|up: row_linear_glu(_qcodes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.bias, self.out_features)

    def run(self, x: torch.Tensor, precision: RowPrecision) -> torch.Tensor:
        """NestedLinear.run's signature: dense weights have one precision."""
        return self(x)


@dataclass
class LayerCut:
    """After layer `after_layer`, only the first `num_rows` rows go on, with metadata `meta` (the rows
    past them stop there: CacheBlend's first pass, engine/model_runner.py)."""

    after_layer: int
    num_rows: int
    meta: AttentionMetadata


@dataclass
class LayerTail:
    """The last layer computes past its KV write only the rows `rows` (those whose hidden state leaves
    the model: the sampled rows), with metadata `meta` for them. Each row's arithmetic is the same as
    in the full layer; the other rows' last-layer KV is written all the same."""

    rows: torch.Tensor  # [k] int64 indices into the step's rows
    meta: AttentionMetadata


# RoPE types whose frequencies are fixed (HF's dynamic_rope_update leaves them alone): a position's cos
# and sin are then a function of the position only. "dynamic" and "longrope" change with the length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeTable:
    """cos and sin of the model's own rotary module, computed once for positions [0, n) and read by
    index each step (HF's module recomputes them: about 0.4 ms of a 128-row decode step of
    tiny-random-llama). Each value is elementwise in its position (an outer product, then cos / sin),
    so a row of the table is bitwise the module's output for that position alone
    (`test_rope_table_is_the_rotary_modules_output_bitwise`). Grown by doubling; RoPE types whose
    frequencies change with the length (not in STATIC_ROPE_TYPES) call the module every step."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") in STATIC_ROPE_TYPES
        self.cos = self.sin = torch.empty(0)

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] cos and sin for `positions` [T] int64, in like's dtype, contiguous."""
        if not self.static:
            cos, sin = self.rotary(like, positions.unsqueeze(0))
            return cos[0].contiguous(), sin[0].contiguous()
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.cos.shape[0] or self.cos.dtype != like.dtype:
            n = max(1024, 1 << (top - 1).bit_length(), self.cos.shape[0])
            cos, sin = self.rotary(like, torch.arange(n, device=positions.device).unsqueeze(0))
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


@dataclass
class FusedLayer:
    post_norm: torch.Tensor
    next_norm: torch.Tensor  # the next layer's input norm; after the last layer, the final norm
    qkv: FusedLinear | NestedLinear
    o: FusedLinear | NestedLinear
    gate_up: FusedLinear | NestedLinear
    down: FusedLinear | NestedLinear


def unsupported_reason(model: nn.Module, ext: ModuleType | None) -> str:
    """'' when `model` can run through FusedLlamaForward, else why not."""
    config = model.config
    if ext is None:
        return "the CPU extension is unavailable"
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if sliding_window(config):
        return "it has sliding-window layers (the fused forward passes no window to attention)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        ]
        kind = type(linears[0])
        if kind not in (RowInvariantLinear, NestedLinear) or any(type(m) is not kind for m in linears):
            return "its linear layers are not on the CPU extension (fp32, bf16 or NestedFP on CPU)"
        if any(
            type(n).__name__ not in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
            for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ):
            return "its norms are not the Llama-family RMSNorm"
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            lanes = panel_width(group[0])
            if any(m.out_features % lanes or _dtype(m) != _dtype(group[0]) for m in group):
                return f"projections of {[m.out_features for m in group]} features are not whole {lanes}-wide panels"
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):  # torch's, transformers' (F.silu)
            return "its MLP activation is not SiLU"
    return ""


def _dtype(linear: RowInvariantLinear | NestedLinear) -> torch.dtype:
    """The packed weight's kind: projections fused into one call must share it."""
    if isinstance(linear, NestedLinear):
        return torch.uint8
    return torch.int8 if linear.codes is not None else linear.dtype


def panel_width(linear: RowInvariantLinear | NestedLinear) -> int:
    """Output features per panel of the kernel's packed weight (csrc/cpu/linear_cpu.cpp)."""
    if isinstance(linear, NestedLinear):
        return linear.panel_width
    return linear.lanes


def fuse(linears: list[Any], ext: ModuleType) -> FusedLinear | NestedLinear:
    """One call for several projections of the same input. Their packs are concatenated (whole panels:
    every out_features must be a multiple of the panel width) and each module's `packed` becomes a view
    of the concatenation, so memory does not grow. NestedFP projections concatenate the same way."""
    if isinstance(linears[0], NestedLinear):
        return concat(linears)
    first = linears[0]
    if len(linears) == 1:
        return FusedLinear(first.packed, first.bias, first.out_features, first.kernel, first.glu_kernel)
    lanes = panel_width(first)
    if any(m.out_features % lanes for m in linears):
        raise ValueError(f"out_features {[m.out_features for m in linears]} are not multiples of {lanes}")
    if any(m.layout != first.layout for m in linears):  # packed codes: one layout per call
        raise ValueError(f"code layouts differ: {[m.layout for m in linears]}")
    packed = torch.cat([m.packed for m in linears])
    start = 0
    for m in linears:
        panels = m.packed.shape[0]
        m.packed = packed[start : start + panels]
        start += panels
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat(
            [
                b if b is not None else torch.zeros(m.out_features, dtype=m.dtype)
                for b, m in zip(biases, linears)
            ]
        )
    return FusedLinear(packed, bias, sum(m.out_features for m in linears), first.kernel, first.glu_kernel)


class FusedLlamaForward:
    """decoder(input_ids) -> last hidden states [num_tokens, hidden] for one packed step: of the rows
    left after the cuts, or with a tail, of its rows only (the sampled rows: the last layer computes
    no other row past its KV write)."""

    def __init__(self, model: nn.Module, ext: ModuleType):
        reason = unsupported_reason(model, ext)
        if reason:
            raise ValueError(f"fused forward unsupported: {reason}")
        config = model.config
        self.ext = ext
        self.decoder = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        first_attn = self.decoder.layers[0].self_attn
        self.head_dim = first_attn.head_dim
        self.scale = first_attn.scaling
        self.eps = self.decoder.norm.variance_epsilon
        self.rope = RopeTable(self.decoder.rotary_emb)
        layers = self.decoder.layers
        self.first_norm = layers[0].input_layernorm.weight.detach()
        next_norms = [layer.input_layernorm.weight.detach() for layer in layers[1:]]
        next_norms.append(self.decoder.norm.weight.detach())
        self.layers = []
        for layer, next_norm in zip(layers, next_norms, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                FusedLayer(
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    next_norm=next_norm,
                    qkv=fuse([attn.q_proj, attn.k_proj, attn.v_proj], ext),
                    o=fuse([attn.o_proj], ext),
                    gate_up=fuse([mlp.gate_proj, mlp.up_proj], ext),
                    down=fuse([mlp.down_proj], ext),
                )
            )

    def gated(
        self, gate_up: FusedLinear | NestedLinear, x: torch.Tensor, precision: RowPrecision
    ) -> torch.Tensor:
        """silu(gate) * up: dense weights in one extension call (row_linear_glu: on AMX the activation is
        the GEMM's epilogue, and the [rows, 2 inter] product is never stored), NestedFP through torch."""
        inter = gate_up.out_features // 2
        if isinstance(gate_up, FusedLinear):
            return gate_up.glu_kernel(x, gate_up.packed, gate_up.bias, inter)
        both = gate_up.run(x, precision)
        return F.silu(both[:, :inter]) * both[:, inter:]

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        position_ids: torch.Tensor,  # [num_tokens] int64
        kv_layers: list[LayerKV],
        backend: AttentionBackend,
        meta: AttentionMetadata,
        cuts: list[LayerCut] | None = None,
        precision: RowPrecision | None = None,  # NestedFP weights: each row's mode (default FP16)
        tail: LayerTail | None = None,  # with no cuts: only these rows past the last layer's KV write
    ) -> torch.Tensor:
        ext = self.ext
        precision = precision or RowPrecision()
        cut_at = {c.after_layer: c for c in cuts or []}
        hidden = self.decoder.embed_tokens(input_ids)  # [T, hidden], the residual stream
        cos, sin = self.rope(hidden, position_ids)  # [T, head_dim]
        q_cols = self.num_heads * self.head_dim
        kv_cols = self.num_kv_heads * self.head_dim
        rows = hidden.shape[0]
        x = ext.rms_norm(hidden, self.first_norm, self.eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv.run(x, precision)  # [T, q_cols + 2 kv_cols]
            ext.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
            k = qkv[:, q_cols : q_cols + kv_cols].view(rows, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_cols + kv_cols :].view(rows, self.num_kv_heads, self.head_dim)
            kv_layers[i].write(meta.slot_mapping, k, v)
            q = qkv[:, :q_cols].view(rows, self.num_heads, self.head_dim)
            if tail is not None and i == len(self.layers) - 1:  # the rows that leave the model
                assert not cuts, "a tail takes no cuts"
                rows, meta = tail.rows.numel(), tail.meta
                if rows == 0:  # nothing sampled (a prompt's slice before its last): only the KV was needed
                    x = x[:0]
                    break
                q, hidden = q.index_select(0, tail.rows), hidden.index_select(0, tail.rows)
            attn = backend.forward(q, kv_layers[i], meta, self.scale)  # [T, heads, head_dim]
            o = layer.o.run(attn.reshape(rows, q_cols), precision)
            x = ext.add_rms_norm_(hidden, o, layer.post_norm, self.eps)
            mlp = layer.down.run(self.gated(layer.gate_up, x, precision), precision)
            x = ext.add_rms_norm_(hidden, mlp, layer.next_norm, self.eps)
            cut = cut_at.get(i)
            if cut is not None:  # row slices of contiguous tensors stay contiguous
                rows = cut.num_rows
                hidden, x, cos, sin, meta = hidden[:rows], x[:rows], cos[:rows], sin[:rows], cut.meta
                precision = precision.head(rows)
                if rows == 0:  # every row stopped: no later layer has work
                    break
        return x

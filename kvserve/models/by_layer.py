"""The HF decoder run layer by layer, for steps whose rows stop early (a content-reuse repair's first
pass: LayerCut)."""

from __future__ import annotations

import torch

from kvserve.attention.forward_context import ForwardContext, forward_context
from kvserve.models.fused_llama import LayerCut
from kvserve.models.hf_adapter import PoolCache


def forward_by_layer(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,  # [1, T]
    position_ids: torch.Tensor,  # [1, T]
    cuts: list[LayerCut],
    ctx: ForwardContext,
) -> torch.Tensor:
    """HF's decoder layers one by one, dropping rows at the cuts (their rows stop after that layer):
    the decoder's own forward (embed, rotary, layers, norm) for the model families whose decoder is
    embed -> layers(hidden, position_embeddings) -> norm (approximate reuse's, the only ones whose
    batches have cuts). Returns the rows left after the last cut, normed [rows, hidden]."""
    hidden = decoder.embed_tokens(input_ids)  # [1, T, hidden]
    cos, sin = decoder.rotary_emb(hidden, position_ids=position_ids)
    by_layer = {c.after_layer: c for c in cuts}
    with forward_context(ctx):
        for idx, layer in enumerate(decoder.layers):
            out = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                past_key_values=PoolCache(),
                use_cache=True,
                position_embeddings=(cos, sin),
            )
            hidden = out[0] if isinstance(out, tuple) else out
            cut = by_layer.get(idx)
            if cut is not None:
                r = cut.num_rows
                hidden, position_ids, cos, sin = hidden[:, :r], position_ids[:, :r], cos[:, :r], sin[:, :r]
                ctx.meta = cut.meta
                if r == 0:  # every row stopped: no later layer has work
                    break
    return decoder.norm(hidden)[0]

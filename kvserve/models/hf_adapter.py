"""Drive unchanged Hugging Face modeling code with kvserve's KV pool and attention.

- `kvserve_attention` is registered in transformers' AttentionInterface as "kvserve"; no mask
  function is registered under that name, so transformers builds no mask (our backends apply the
  causal rule per packed sequence, and a sliding-window layer's window, which the modeling code
  passes as `sliding_window`).
- `PoolCache` is passed as `past_key_values`: `update` writes the new tokens' K/V (already rotated
  by the model) into the pool slots of the current step and hands them back unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from kvserve.attention.forward_context import get_forward_context
from kvserve.errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "kvserve"


def kvserve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    ctx = get_forward_context()
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")  # a sliding-window layer's (Gemma 2/3, Mistral): (p - W, p]
    layer = module.layer_idx
    out = ctx.backend.forward(q, ctx.layers[layer], ctx.meta_of(layer), scale, window=window or None)
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim]


AttentionInterface.register(ATTN_IMPLEMENTATION, kvserve_attention)


class PoolCache(Cache):
    """past_key_values for one packed step: writes K/V to the pool at the step's slot mapping."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = get_forward_context()
        k = key_states[0].transpose(0, 1)  # [num_tokens, num_kv_heads, head_dim]
        v = value_states[0].transpose(0, 1)
        ctx.layers[layer_idx].write(ctx.meta_of(layer_idx).slot_mapping, k, v)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def sliding_window(config: object) -> int | None:
    """The window of the model's sliding-window layers (tokens a row sees, itself included), or None
    when every layer attends to the whole context."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and all(t == "full_attention" for t in layer_types):
        return None
    return int(window)


def layer_windows(config: object) -> list[int | None]:
    """Each layer's window (None: it attends to the whole context), as the modeling code passes it:
    `layer_types` names the sliding layers where the config has it (Gemma 3), else every layer
    slides (Mistral) or none does."""
    num_layers = int(config.num_hidden_layers)
    window = sliding_window(config)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    return [window if t == "sliding_attention" else None for t in layer_types]


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models kvserve cannot drive, naming the reason."""
    config = model.config
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' attention interface"
        )
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        raise UnsupportedModelError(
            f"{name} is not a decoder-only RoPE model (kvserve needs model.layers and model.rotary_emb; "
            "absolute position embeddings cannot be served)"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            f"{name} soft-caps its attention logits (Gemma 2), which kvserve's attention backends do not"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{name} attends bidirectionally (an encoder): kvserve serves causal decoders"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model")

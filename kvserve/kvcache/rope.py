"""Moving post-RoPE keys to new positions.

A key stored at position p is R(p) k. Rotations compose, R(p') = R(p' - p) R(p), so moving it to p'
applies R(delta) with angle delta * inv_freq[i] per frequency, using the model's own inverse
frequencies (plain, linear, llama3 and NTK-style scalings only change inv_freq). The attention factor
of YaRN-style scalings is already inside the stored K and is not applied again. With partial rotary
only the first rotary_dim dimensions turn. Pairing follows HF's rotate_half (first half, second half).

`self_check` verifies the algebra on the real model: K computed with all positions shifted by delta
must equal the unshifted K rotated by delta, at every layer, to fp32 precision.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.errors import UnsupportedModelError

# rope types whose frequencies do not depend on the sequence length
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "ntk")


class RopeRotator:
    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        self.inv_freq = inv_freq.detach().double().cpu()  # [rotary_dim // 2]
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.head_dim = head_dim
        assert self.rotary_dim <= head_dim

    @classmethod
    def from_model(cls, model: Any) -> RopeRotator:
        """Refuses (UnsupportedModelError) models where moving K is not a pure rotation."""
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise UnsupportedModelError("the model has no rotary embedding: its KV cannot be moved")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} changes its frequencies with the sequence length: moving KV "
                "is not a pure rotation; use --reuse prefix"
            )
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(rotary.inv_freq, head_dim)

    def rotation(
        self, delta: torch.Tensor, dtype: torch.dtype, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """delta [T] int -> (cos, sin), each [T, 1, rotary_dim // 2]; compute once, apply per layer."""
        angles = delta.double().cpu().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, rotary_dim/2] fp64
        return (
            torch.cos(angles).to(dtype).to(device).unsqueeze(1),
            torch.sin(angles).to(dtype).to(device).unsqueeze(1),
        )

    def apply(self, key: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """key [T, H, D] post-RoPE -> key rotated by the deltas `rotation` was made for."""
        cos, sin = rotation
        half = self.rotary_dim // 2
        x1, x2 = key[..., :half], key[..., half : self.rotary_dim]
        out = torch.empty_like(key)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : self.rotary_dim] = x2 * cos + x1 * sin
        out[..., self.rotary_dim :] = key[..., self.rotary_dim :]
        return out

    def rotate(self, key: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """key [T, H, D] post-RoPE, delta [T] int (new - old position) -> key rotated by delta."""
        return self.apply(key, self.rotation(delta, key.dtype, key.device))


@torch.inference_mode()
def self_check(model: Any, rotator: RopeRotator, delta: int = 777, num_tokens: int = 24) -> tuple[bool, str]:
    """(ok, detail): shifted-position K vs rotated K at every layer of the real model."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), generator=generator).to(device)
    keys = []
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        for shift in (0, delta):
            cache = DynamicCache(config=model.config)
            pos = (torch.arange(num_tokens, device=device) + shift).unsqueeze(0)
            model.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            keys.append([layer.keys[0].transpose(0, 1).float() for layer in cache.layers])  # type: ignore[index,union-attr]
    finally:
        model.config._attn_implementation = saved
    worst = 0.0
    for k0, k1 in zip(*keys):
        moved = rotator.rotate(k0, torch.full((num_tokens,), delta))
        worst = max(worst, ((moved - k1).norm() / k1.norm().clamp_min(1e-12)).item())
    ok = worst < 1e-3
    return ok, f"relative error of re-rotated K vs K computed at the new positions: {worst:.2e}"

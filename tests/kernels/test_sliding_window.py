"""Sliding-window layers (Gemma 2/3, Mistral): a row at position p sees KV positions (p - W, p].

The reference backend's window against a direct computation; the CPU extension's (cpu_paged, every KV
format it reads in place and one it reads through a dense copy) against the reference, for windows
inside one online-softmax step, across steps (64 tokens) and splits (256), and wider than the
sequence; its batch invariance with a window (a row's output is bitwise the same alone, in pieces or
packed); the backends that take no window refuse one.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.reference import ReferenceBackend, attention_one_sequence
from kvserve.attention.registry import create_backend
from kvserve.attention.testing import make_batch
from kvserve.errors import ConfigError
from kvserve.kernels import cpu_ext
from tests.kernels.test_cpu_invariance import assert_rows_equal, batch

needs_ext = pytest.mark.skipif(cpu_ext.load_or_none() is None, reason="the CPU extension is unavailable")

WINDOWS = [
    1,
    5,
    16,
    64,
    100,
    300,
    5000,
]  # one token, inside a block, a block, a step, across steps, a split, all


def direct(q, k, v, scale, window):
    """Attention of rows ending at len(k) over (p - window, p], one row at a time, in float64."""
    q_len, h, d = q.shape
    seq_len, h_kv, _ = k.shape
    out = torch.empty(q_len, h, d, dtype=torch.float64)
    for j in range(q_len):
        p = seq_len - q_len + j
        lo = max(0, p - window + 1)
        kk = k[lo : p + 1].double().repeat_interleave(h // h_kv, dim=1)  # [n, H, D]
        vv = v[lo : p + 1].double().repeat_interleave(h // h_kv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[j].double(), kk) * scale
        out[j] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv)
    return out


@pytest.mark.parametrize("window", [1, 7, 40])
def test_reference_window_is_the_direct_computation(window):
    gen = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((9, 4), (50, 2), (50, 2)))
    got = attention_one_sequence(q, k, v, 0.25, window)
    torch.testing.assert_close(got.double(), direct(q, k, v, 0.25, window), atol=1e-6, rtol=0)
    # no window and a window past the sequence are plain causal attention
    assert torch.equal(attention_one_sequence(q, k, v, 0.25, 500), attention_one_sequence(q, k, v, 0.25))


@needs_ext
@pytest.mark.parametrize("fmt", ["fp32", "bf16q", "fp8_e4m3", "int8", "int4"])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_extension_window_matches_the_reference(fmt, window):
    query, kv, meta, scale = batch("smollm2", fmt)
    got = CpuPagedBackend().forward(query, kv, meta, scale, window)
    want = ReferenceBackend().forward(query.float(), kv, meta, scale, window)
    tol = 2e-2 if fmt == "bf16q" else 2e-5
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    if window < 1300:  # the decode row at 1299 sees only its window: the result is not plain causal
        assert not torch.allclose(
            got.float(), ReferenceBackend().forward(query.float(), kv, meta, scale), atol=tol
        )


@needs_ext
@pytest.mark.parametrize("fmt", ["fp32", "bf16q", "fp8_e4m3"])
@pytest.mark.parametrize("window", [37, 300])
def test_cpu_extension_window_is_batch_invariant(fmt, window):
    """Each row's output with a window is bitwise the same alone, in pieces or in the whole batch."""
    query, kv, meta, scale = batch("smollm2", fmt)
    backend = CpuPagedBackend()

    class Windowed:
        def forward(self, q, kv, m, s):
            return backend.forward(q, kv, m, s, window)

    full = backend.forward(query, kv, meta, scale, window)
    for i, (q_len, _) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        assert_rows_equal(Windowed(), query, kv, meta, scale, full, [(i, 0, q_len)], f"sequence {i} alone")
        if q_len > 1:
            cut = q_len // 3
            assert_rows_equal(Windowed(), query, kv, meta, scale, full, [(i, 0, cut)], f"sequence {i} head")
            assert_rows_equal(
                Windowed(), query, kv, meta, scale, full, [(i, cut, q_len)], f"sequence {i} tail"
            )


def test_backends_without_a_window_are_refused_for_windowed_models():
    """create_backend: a named backend that takes no window is a ConfigError that says which do; auto
    on CPU takes cpu_paged, which does."""
    with pytest.raises(ConfigError, match="sliding-window"):
        create_backend("cuda", torch.device("cpu"), head_dim=64, windowed=True)
    assert create_backend("auto", torch.device("cpu"), head_dim=64, windowed=True).takes_window


def test_torch_ops_path_takes_the_window_through_the_reference():
    query, dense, meta = make_batch([(30, 90), (1, 200)], 4, 2, 16, 16, torch.float32, "mixed")
    got = CpuPagedBackend(use_extension=False).forward(query, dense, meta, 0.25, 20)
    torch.testing.assert_close(got, ReferenceBackend().forward(query, dense, meta, 0.25, 20))


def test_which_models_are_windowed_and_which_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvserve.errors import UnsupportedModelError
    from kvserve.models.hf_adapter import check_supported, sliding_window

    tiny = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    gemma3 = AutoConfig.for_model("gemma3_text", sliding_window=24, **tiny)
    assert sliding_window(gemma3) == 24
    full = AutoConfig.for_model(
        "gemma3_text", sliding_window=24, layer_types=["full_attention", "full_attention"], **tiny
    )
    assert sliding_window(full) is None
    assert (
        sliding_window(AutoConfig.for_model("qwen2", sliding_window=4096, use_sliding_window=False, **tiny))
        is None
    )
    assert sliding_window(AutoConfig.for_model("llama", **tiny)) is None
    check_supported(AutoModelForCausalLM.from_config(gemma3))
    gemma2 = AutoConfig.for_model("gemma2", attn_logit_softcapping=50.0, **tiny)
    with pytest.raises(UnsupportedModelError, match="soft-caps its attention logits"):
        check_supported(AutoModelForCausalLM.from_config(gemma2))
    bidirectional = AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True, **tiny)
    with pytest.raises(UnsupportedModelError, match="bidirectionally"):
        check_supported(AutoModelForCausalLM.from_config(bidirectional))

"""The extension's rotate_keys: moved keys bitwise RopeRotator.apply_reference (the torch ops)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kvcache.rope import RopeRotator


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "heads"), [(64, 64, 3), (128, 128, 2), (64, 32, 5), (16, 16, 1)]
)
def test_rotate_keys_is_the_reference_bitwise(ext, dtype, head_dim, rotary_dim, heads):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim + heads)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rotator = RopeRotator(inv_freq, head_dim)
    for rows in (0, 1, 7, 700, 1500):  # 700 and 1500 cross the reference's pieces and the threads' chunks
        key = (torch.randn(rows, heads, head_dim, generator=gen) * 4).to(dtype)
        delta = torch.randint(-5000, 5000, (rows,), generator=gen)
        rotation = rotator.rotation(delta, "cpu")
        want = rotator.apply_reference(key, rotation)
        rotator.ext = ext
        got = rotator.apply(key, rotation)
        rotator.ext = None
        assert got.dtype == dtype and got.shape == key.shape
        assert torch.equal(
            got.view(torch.uint8) if dtype != torch.float32 else got,
            want.view(torch.uint8) if dtype != torch.float32 else want,
        ), (rows, dtype)
        if rotary_dim < head_dim:
            assert torch.equal(got[..., rotary_dim:], key[..., rotary_dim:])  # passed through


def test_the_engine_moves_keys_with_the_extension_on_cpu():
    from kvserve import LLM
    from kvserve.kernels import cpu_ext

    if cpu_ext.unavailable_reason():
        pytest.skip(cpu_ext.unavailable_reason())
    llm = LLM(model="tiny-random-llama", reuse="any", max_cache_bytes=20_000_000)
    assert llm.engine.reuse.repairer is not None and llm.engine.reuse.repairer.rotator.ext is not None

import pytest
import torch

from kvserve.errors import ConfigError
from kvserve.kvcache.kv_storage import DenseLayerKV
from kvserve.kvcache.quantized_storage import QuantizedLayerKV, create_layer_kv
from kvserve.quant.registry import CODEC_NAMES, make_codec

# Hand-computed bits per element for (H=8, D=128, block 16), every scale, zero and norm included.
EXPECTED_BITS = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "int8": ((8 + 32 / 16) + (8 + 32 / 64)) / 2,  # K: fp16 scale+zero per channel per block
    "int4": ((4 + 32 / 16) + (4 + 32 / 64)) / 2,  # V: fp16 scale+zero per 64 channels
    "int3": ((3 + 32 / 16) + (3 + 32 / 64)) / 2,
    "int2": ((2 + 32 / 16) + (2 + 32 / 64)) / 2,
    # K: uint8 scale+zero per channel per block, plus three fp16 grid values per head per block
    "int4dq": ((4 + 16 / 16 + 48 / (16 * 128)) + (4 + 32 / 64)) / 2,
    "int3dq": ((3 + 16 / 16 + 48 / (16 * 128)) + (3 + 32 / 64)) / 2,
    "int2dq": ((2 + 16 / 16 + 48 / (16 * 128)) + (2 + 32 / 64)) / 2,
    "fp8_e4m3": 8 + 32 / 128,  # fp32 scale per (token, head)
    "nvfp4": 4 + 8 / 16 + 32 / (8 * 128),  # e4m3 per 16, fp32 global per token
    "mxfp4": 4 + 8 / 32,  # ue8m0 per 32
    "turbo4": 4 + 16 / 128,  # fp16 norm
    "turbo3.5": 3.5 + 16 / 128,
    "turbo3": 3 + 16 / 128,
    "turbo2.5": 2.5 + 16 / 128,
    "turbo2": 2 + 16 / 128,
    # K from the first codec, V from the second: the mean of the two halves above
    "kturbo4-vturbo2": ((4 + 16 / 128) + (2 + 16 / 128)) / 2,
    "kturbo3-vturbo2": ((3 + 16 / 128) + (2 + 16 / 128)) / 2,
    "kint4-vturbo2": ((4 + 32 / 16) + (2 + 16 / 128)) / 2,
    "kint3-vturbo3": ((3 + 32 / 16) + (3 + 16 / 128)) / 2,
    "kint3-vturbo2": ((3 + 32 / 16) + (2 + 16 / 128)) / 2,
    "kint2-vturbo2": ((2 + 32 / 16) + (2 + 16 / 128)) / 2,
    "kint3dq-vturbo3": ((3 + 16 / 16 + 48 / (16 * 128)) + (3 + 16 / 128)) / 2,
    "kint3dq-vturbo2.5": ((3 + 16 / 16 + 48 / (16 * 128)) + (2.5 + 16 / 128)) / 2,
    "kint3dq-vturbo2": ((3 + 16 / 16 + 48 / (16 * 128)) + (2 + 16 / 128)) / 2,
}


def test_every_codec_has_expected_bits():
    assert set(EXPECTED_BITS) == set(CODEC_NAMES)
    for name, bits in EXPECTED_BITS.items():
        codec = make_codec(name, 8, 128)
        assert codec.bits_per_element(16) == pytest.approx(bits), name
        assert codec.bytes_per_token(16) == pytest.approx(bits * 2 * 8 * 128 / 8)


def test_capacity_vs_bf16_within_3_percent_of_theory():
    dense = DenseLayerKV(4, 16, 8, 128, torch.bfloat16)
    for name, bits in EXPECTED_BITS.items():
        if name in ("fp32", "fp16", "bf16"):
            continue
        kv = create_layer_kv(name, 4, 16, 8, 128, torch.bfloat16, "cpu")
        stored = sum(
            f.numel() * f.element_size() for b in (kv.k_blocks, kv.v_blocks) for f in b.fields.values()
        )
        assert stored == 4 * kv.bytes_per_block()  # the accounting is what is allocated
        ratio = dense.bytes_per_block() / kv.bytes_per_block()
        assert ratio == pytest.approx(16 / bits, rel=0.03), name


def test_headline_capacity():
    ratio = {n: 16 / make_codec(n, 8, 128).bits_per_element() for n in ("fp8_e4m3", "turbo4", "turbo3")}
    assert ratio["fp8_e4m3"] > 1.9 and ratio["turbo4"] > 3.8 and ratio["turbo3"] > 5


def test_unknown_name_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'int5'.*int4"):
        make_codec("int5", 2, 64)


@pytest.mark.parametrize(
    "name,head_dim,need",
    [("turbo4", 80, "power of two"), ("mxfp4", 48, "multiple of its 32"), ("int4", 72, "multiple of 16")],
)
def test_head_dim_the_format_cannot_pack(name, head_dim, need):
    with pytest.raises(ConfigError, match=need) as info:
        make_codec(name, 2, head_dim)
    assert "formats that work with head_dim" in info.value.message
    assert "fp8_e4m3" in info.value.message and info.value.param == "kv_cache_dtype"


def test_factory_picks_dense_for_passthrough():
    assert isinstance(create_layer_kv("auto", 2, 16, 2, 64, torch.float32, "cpu"), DenseLayerKV)
    assert isinstance(create_layer_kv("bf16", 2, 16, 2, 64, torch.bfloat16, "cpu"), DenseLayerKV)
    kv = create_layer_kv("fp16", 2, 16, 2, 64, torch.float32, "cpu")  # storage dtype != compute dtype
    assert isinstance(kv, QuantizedLayerKV) and kv.bytes_per_block() == 2 * 16 * 2 * 64 * 2

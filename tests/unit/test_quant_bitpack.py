import pytest
import torch

from kvserve.quant.bitpack import pack_bits, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip_and_size(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_is_dense_little_endian():
    codes = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 7]], dtype=torch.uint8)
    assert pack_bits(codes, 3).tolist() == [[1, 0, 0b11100000]]

import pytest
import torch

from kvserve.kvcache.quantized_storage import QuantizedLayerKV

BS, H, D = 16, 2, 64


def expected_blocks(kv, k, v, num_full):
    """Per-block expectation for tokens written into consecutive blocks: [n, BS, H, D] each."""
    n = k.shape[0] // BS
    kb, vb = k.view(n, BS, H, D), v.view(n, BS, H, D)
    if kv.codec.k.per_token:
        k_exp = kv.codec.k.roundtrip(kb)
    else:  # full blocks round trip per channel; the open block is kept exact
        k_exp = torch.cat([kv.codec.k.roundtrip(kb[:num_full]), kb[num_full:]])
    return k_exp, kv.codec.v.roundtrip(vb)


def make_kv(name, num_blocks=6):
    return QuantizedLayerKV(name, num_blocks, BS, H, D, torch.float32)


@pytest.mark.parametrize("name", ["int4", "int8", "fp8_e4m3", "nvfp4", "turbo3.5"])
@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_gather_equals_codec_roundtrip(name, chunk):
    kv = make_kv(name)
    block_ids = torch.tensor([4, 1, 3])
    k, v = torch.randn(48, H, D), torch.randn(48, H, D)
    k[:, :, 7] *= 20
    slots = (block_ids.repeat_interleave(BS) * BS + torch.arange(BS).repeat(3))[:40]  # 2.5 blocks
    for start in range(0, 40, chunk):
        kv.write(slots[start : start + chunk], k[start : start + chunk], v[start : start + chunk])
    k_got, v_got = kv.gather(block_ids)
    k_exp, v_exp = expected_blocks(kv, k, v, num_full=2)
    assert torch.allclose(k_got[:2], k_exp[:2], atol=1e-6)
    assert torch.allclose(k_got[2, :8], k_exp[2, :8], atol=1e-6)  # only 8 slots of block 3 written
    assert torch.allclose(v_got[2, :8], v_exp[2, :8], atol=1e-6)
    assert torch.allclose(v_got[:2], v_exp[:2], atol=1e-6)
    shadow = 0 if kv.codec.k.per_token else BS * H * D * 4  # one open block, fp32
    assert kv.shadow_bytes() == shadow


def test_block_codec_quantizes_when_block_fills():
    kv = make_kv("int2")
    k, v = torch.randn(BS, H, D), torch.randn(BS, H, D)
    slots = torch.arange(BS) + 2 * BS
    kv.write(slots[:-1], k[:-1], v[:-1])
    assert torch.equal(kv.gather(torch.tensor([2]))[0][0, :-1], k[:-1])  # open: full precision
    kv.write(slots[-1:], k[-1:], v[-1:])
    assert kv.shadow_bytes() == 0
    assert torch.equal(kv.gather(torch.tensor([2]))[0][0], kv.codec.k.roundtrip(k[None])[0])


def test_write_at_offset_zero_restarts_block():
    kv = make_kv("int4")
    kv.write(torch.arange(5), torch.randn(5, H, D), torch.randn(5, H, D))
    k = torch.randn(BS, H, D)
    kv.write(torch.arange(BS), k, torch.randn(BS, H, D))
    assert torch.equal(kv.gather(torch.tensor([0]))[0][0], kv.codec.k.roundtrip(k[None])[0])


def test_rewrite_inside_closed_block_reencodes_it():
    kv = make_kv("int4")
    k = torch.randn(BS, H, D)
    kv.write(torch.arange(BS), k, k)
    patch = torch.randn(3, H, D)
    kv.write(torch.arange(5, 8), patch, patch)
    assert kv.shadow_bytes() == 0
    expected = kv.codec.k.roundtrip(k[None])[0]
    expected[5:8] = patch
    assert torch.allclose(kv.gather(torch.tensor([0]))[0][0], kv.codec.k.roundtrip(expected[None])[0])


def test_negative_slots_are_skipped():
    kv = make_kv("int4")
    before = kv.gather(torch.arange(6))
    kv.write(torch.tensor([-1, -1]), torch.randn(2, H, D), torch.randn(2, H, D))
    after = kv.gather(torch.arange(6))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    kv.write(torch.tensor([BS, -1, BS + 1]), k, v)
    k_got, v_got = kv.gather(torch.tensor([1]))
    assert torch.equal(k_got[0, :2], k[[0, 2]])
    assert torch.allclose(v_got[0, :2], kv.codec.v.roundtrip(v[[0, 2]]))


@pytest.mark.parametrize("name", ["int4", "fp8_e4m3"])
def test_copy_blocks_full_and_open(name):
    kv = make_kv(name)
    k, v = torch.randn(24, H, D), torch.randn(24, H, D)
    kv.write(torch.arange(24), k, v)  # block 0 full, block 1 has 8 slots
    kv.copy_blocks(torch.tensor([0, 1]), torch.tensor([4, 5]))
    src, dst = kv.gather(torch.tensor([0, 1])), kv.gather(torch.tensor([4, 5]))
    assert torch.equal(src[0][:, :8], dst[0][:, :8]) and torch.equal(src[1][:, :8], dst[1][:, :8])
    assert torch.equal(src[0][0], dst[0][0]) and torch.equal(src[1][0], dst[1][0])
    more = torch.randn(8, H, D)  # the private copy continues where the source stopped
    kv.write(5 * BS + 8 + torch.arange(8), more, more)
    k_dst = kv.gather(torch.tensor([5]))[0][0]
    expected = kv.codec.k.roundtrip(torch.cat([k[16:], more])[None])[0]
    if kv.codec.k.per_token:
        expected = kv.codec.k.roundtrip(torch.cat([k[16:], more]))
    assert torch.allclose(k_dst, expected, atol=1e-6)
    assert kv.shadow_bytes() == (0 if kv.codec.k.per_token else BS * H * D * 4)  # block 1 still open


def test_freed_block_drops_shadow_and_bf16_compute():
    kv = QuantizedLayerKV("int8", 4, BS, H, D, torch.bfloat16)
    kv.write(torch.arange(3), torch.randn(3, H, D), torch.randn(3, H, D))
    assert kv.shadow_bytes() == BS * H * D * 2
    k, v = kv.gather(torch.tensor([0]))
    assert k.dtype == v.dtype == torch.bfloat16 and k.shape == (1, BS, H, D)
    kv.on_block_freed(0)
    assert kv.shadow_bytes() == 0


def test_open_shadows_are_one_tensor_kernels_can_read():
    """slot_of_block / pool (what kernels read) agree with gather while the pool grows and shrinks."""
    kv = make_kv("int8", num_blocks=12)
    k, v = torch.randn(12 * BS, H, D), torch.randn(12 * BS, H, D)
    for b in range(10):  # ten open blocks with 3 slots each: the pool grows from 4 to 16 rows
        kv.write(b * BS + torch.arange(3), k[b * BS : b * BS + 3], v[b * BS : b * BS + 3])
    kv.write(torch.arange(3, BS), k[3:BS], v[3:BS])  # block 0 fills: its row is freed
    assert kv.open_k.pool.shape[0] == 16 and int(kv.open_k.slot_of_block[0]) == -1
    gathered = kv.gather(torch.arange(10))[0]
    for b in range(1, 10):
        row = int(kv.open_k.slot_of_block[b])
        assert torch.equal(kv.open_k.pool[row, :3], k[b * BS : b * BS + 3])
        assert torch.equal(gathered[b, :3], kv.open_k.pool[row, :3])
    kv.on_block_freed(5)
    assert int(kv.open_k.slot_of_block[5]) == -1 and kv.shadow_bytes() == 8 * BS * H * D * 4

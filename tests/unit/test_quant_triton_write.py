"""Fused quantize-and-scatter kernels vs the torch codecs (TRITON_INTERPRET=1 without a GPU)."""

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvserve.kernels.triton.quant_write import fp8_quant_write, int8_value_quant_write  # noqa: E402
from kvserve.kvcache.packed_blocks import PackedBlocks  # noqa: E402
from kvserve.quant.registry import make_codec  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS, BS, H, D = 4, 4, 2, 64


def inputs(dtype=torch.float32):
    x = torch.randn(7, H, D) * torch.logspace(-4, 4, 7).view(7, 1, 1)
    x[0, 0, :5] = torch.tensor([1e-9, -0.0, 3.0e-3, 500.0, -1e-12])  # subnormal and out-of-range codes
    x[1, 1, 3] = math.nan
    x[2, 0, 9] = math.inf
    x[3] = torch.tensor([0.5, -0.75]).repeat(D // 2)  # ties
    slots = torch.tensor([0, 5, -1, 9, 15, 3, 14])
    return x.to(dtype).to(DEVICE), slots.to(DEVICE)


def reference(name: str, which: str, x, slots):
    blocks = PackedBlocks(getattr(make_codec(name, H, D), which), NUM_BLOCKS, BS, DEVICE)
    keep = slots >= 0
    blocks.write_tokens(slots[keep], x[keep])
    return blocks.fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_write_matches_torch_codec(dtype):
    x, slots = inputs(dtype)
    ref = reference("fp8_e4m3", "k", x, slots)
    codes = torch.zeros_like(ref["codes"])
    scale = torch.zeros_like(ref["scale"])
    fp8_quant_write(x, slots, codes, scale)
    assert torch.equal(scale, ref["scale"])
    nan = ref["codes"].view(torch.float8_e4m3fn).float().isnan()
    assert torch.equal(codes.view(torch.float8_e4m3fn).float().isnan(), nan)
    assert torch.equal(codes[~nan], ref["codes"][~nan])


def test_int8_value_write_matches_torch_codec():
    x, slots = inputs()
    x[x.isnan() | x.isinf()] = 1.0  # min/max quantization has no NaN rule
    ref = reference("int8", "v", x, slots)
    fields = {name: torch.zeros_like(field) for name, field in ref.items()}
    int8_value_quant_write(x, slots, fields["codes"], fields["scale"], fields["zero"], group_size=64)
    for name in ref:
        assert torch.equal(fields[name], ref[name]), name


def test_launcher_rejects_bad_pool():
    x, slots = inputs()
    with pytest.raises(ValueError, match="slot_mapping"):
        fp8_quant_write(x, slots.int(), torch.zeros(4, 4, H, D, dtype=torch.uint8), torch.zeros(4, 4, H))


COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from kvserve.kernels.triton import quant_write as q
common = {"slot_ptr": "*i64", "codes_ptr": "*u8", "stride_xt": "i32", "stride_xh": "i32", "num_kv_heads": "i32"}
for fn, sig, consts in [
    (q._fp8_write_kernel, {"x_ptr": "*bf16", "scale_ptr": "*fp32"}, {"HEAD_DIM": 64}),
    (q._int8_asym_write_kernel, {"x_ptr": "*fp16", "scale_ptr": "*fp16", "zero_ptr": "*fp16"}, {"HEAD_DIM": 128, "GROUP": 64}),
]:
    sig = {**common, **sig, **dict.fromkeys(consts, "constexpr")}
    source = triton.compiler.ASTSource(fn=fn, signature={n: sig[n] for n in fn.arg_names}, constexprs=consts)
    assert "ptx" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
from kvserve.kernels.triton import kv_write
fn = kv_write._dense_write_kernel
sig = {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16",
       "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "num_kv_heads": "i32",
       "num_slots": "i64", "HEAD_DIM": "constexpr"}
source = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={"HEAD_DIM": 128})
assert "ptx" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
"""


def test_kernels_compile_for_sm90():
    """Compiles without a GPU; runs in a subprocess because TRITON_INTERPRET=1 replaces @jit here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kv_fused_writes_equal_the_torch_codec(codec, dtype):
    """QuantizedLayerKV with fused writes (the engine builder attaches them on CUDA) stores exactly what
    the torch codec stores: slot -1 rows unwritten, every field bit for bit (int8: V fused, K through
    the block path), for a prompt then single decode tokens, as the engine writes them."""
    from kvserve.kernels.triton.quant_write import fused_writer
    from kvserve.kvcache.quantized_storage import QuantizedLayerKV

    pools = {fused: QuantizedLayerKV(codec, NUM_BLOCKS, BS, H, D, dtype, DEVICE) for fused in (False, True)}
    pools[True].attach_fused_writes(fused_writer)
    assert pools[True].v_blocks.fused is not None and pools[False].v_blocks.fused is None
    assert (pools[True].k_blocks.fused is not None) == (codec == "fp8_e4m3")  # KIVI K is a block codec
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(12, H, D, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    writes = [
        torch.tensor([0, 1, 2, -1, 3, 4, 5, 6, 7]),
        torch.tensor([8]),
        torch.tensor([-1]),
        torch.tensor([9]),
    ]
    row = 0
    for slots in writes:
        rows = slice(row, row + len(slots))
        for pool in pools.values():
            pool.write(slots.to(DEVICE), k[rows], v[rows])
        row += len(slots)
    for which in ("k_blocks", "v_blocks"):
        ref, fused = getattr(pools[False], which).fields, getattr(pools[True], which).fields
        for name in ref:
            assert torch.equal(fused[name], ref[name]), (which, name)
    blocks = torch.arange(3, device=DEVICE)
    for a, b in zip(pools[True].gather(blocks), pools[False].gather(blocks), strict=True):
        assert torch.equal(a, b)


def test_fused_writer_covers_fp8_and_int8_values_only():
    from kvserve.kernels.triton.quant_write import fused_writer

    assert fused_writer(make_codec("fp8_e4m3", H, D).k) is not None
    assert fused_writer(make_codec("int8", H, D).v) is not None
    for name in ("int4", "mxfp4"):
        assert fused_writer(make_codec(name, H, D).v) is None, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_kv_write_equals_write_torch(dtype):
    """The CUDA dense pool's copy_rows (Triton row scatter, attached by the builder) leaves the pool as
    DenseLayerKV.write_torch does: strided rows, slot -1 skipped, every other slot untouched, int32
    and int64 slots; a slot past the pool is not written."""
    from kvserve.kernels.triton.kv_write import dense_kv_write
    from kvserve.kvcache.kv_storage import DenseLayerKV

    gen = torch.Generator().manual_seed(2)
    rows, heads, dim = 11, 3, 64
    qkv = torch.randn(rows, 5 * heads * dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, 2 * heads * dim : 3 * heads * dim].view(rows, heads, dim)  # strided rows, as the model's
    v = qkv[:, 4 * heads * dim :].view(rows, heads, dim)
    slots = torch.randperm(NUM_BLOCKS * BS * 2, generator=gen)[:rows]
    slots[[1, 6]] = -1
    want, got = (DenseLayerKV(NUM_BLOCKS * 2, BS, heads, dim, dtype, DEVICE) for _ in range(2))
    want.k_cache.normal_(generator=None), want.v_cache.normal_()
    got.k_cache.copy_(want.k_cache), got.v_cache.copy_(want.v_cache)
    want.write_torch(slots.to(DEVICE), k, v)
    got.copy_rows = dense_kv_write
    got.write(slots.to(DEVICE), k, v)
    assert torch.equal(got.k_cache, want.k_cache) and torch.equal(got.v_cache, want.v_cache)
    got.write(slots.to(DEVICE, torch.int32), k * 2, v * 2)
    want.write_torch(slots.to(DEVICE), k * 2, v * 2)
    assert torch.equal(got.k_cache, want.k_cache) and torch.equal(got.v_cache, want.v_cache)
    k_t = (k * 3).transpose(1, 2).contiguous().transpose(1, 2)  # head_dim not unit-stride
    got.write(slots.to(DEVICE), k_t, v)
    want.write_torch(slots.to(DEVICE), k_t, v)
    assert torch.equal(got.k_cache, want.k_cache) and torch.equal(got.v_cache, want.v_cache)
    before = got.k_cache.clone()
    dense_kv_write(got.k_cache, got.v_cache, torch.full((rows,), NUM_BLOCKS * 2 * BS, device=DEVICE), k, v)
    assert torch.equal(got.k_cache, before)
    with pytest.raises(ValueError, match="pool's dtype"):
        dense_kv_write(got.k_cache, got.v_cache, slots.to(DEVICE), k.double(), v.double())


def test_builder_attaches_the_triton_writers_on_cuda_only():
    """attach_row_writer: on a CUDA device, dense pools get the Triton row scatter and fp8 / int8 pools
    their fused writers; on the CPU neither (the CPU extension's kv_write_ is the dense pool's there)."""
    from kvserve.engine.builder import attach_row_writer
    from kvserve.kernels.triton.kv_write import dense_kv_write
    from kvserve.kvcache.kv_storage import DenseLayerKV
    from kvserve.kvcache.quantized_storage import QuantizedLayerKV

    def layers():
        return [
            DenseLayerKV(2, BS, H, D, torch.bfloat16),
            QuantizedLayerKV("fp8_e4m3", 2, BS, H, D, torch.bfloat16),
        ]

    cuda = layers()
    attach_row_writer(cuda, torch.device("cuda"))  # only the device's type is read: no GPU needed
    assert cuda[0].copy_rows is dense_kv_write
    assert cuda[1].k_blocks.fused is not None and cuda[1].v_blocks.fused is not None
    cpu = layers()
    attach_row_writer(cpu, torch.device("cpu"))
    assert cpu[0].copy_rows is not dense_kv_write and cpu[1].v_blocks.fused is None

"""The CPU extension's row_linear and the model wrapper that routes fp32 linear layers to it.
(Row-count invariance, bitwise: test_cpu_invariance.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.cpu_features import has_amx_bf16
from kvserve.models.cpu_linear import RowInvariantLinear, wrap_linears
from tests.kernels.conftest import lanes_only


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 70])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (100, 37), (7, 3), (65, 130)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_torch_linear(ext, rows, shape, with_bias):
    out_f, in_f = shape
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if with_bias else None
    torch.testing.assert_close(linear(ext, x, w, b), F.linear(x, w, b), atol=2e-4, rtol=1e-5)


def linear(ext, x, w, b=None):
    return ext.row_linear(x, ext.pack_linear_weight(w), b, w.shape[0])


def test_output_features_are_independent_of_the_panels_around_them(ext):
    """An output computed in a panel of 16 (or 8) equals the same output alone, bitwise."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 576, generator=gen), torch.randn(37, 576, generator=gen)
    y = linear(ext, x, w)
    for o in range(37):
        assert torch.equal(y[:, o], linear(ext, x, w[o : o + 1].contiguous())[:, 0])


def test_splits_output_rows_across_threads(ext):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w = torch.randn(130, 576), torch.randn(3000, 576)
        torch.testing.assert_close(linear(ext, x, w), F.linear(x, w), atol=2e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_rejects_bad_arguments(ext):
    w = ext.pack_linear_weight(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="fp32"):
        ext.row_linear(torch.randn(2, 16).double(), w, None, 8)
    with pytest.raises(RuntimeError, match="in_features"):
        ext.row_linear(torch.randn(2, 15), w, None, 8)
    with pytest.raises(RuntimeError, match="bias"):
        ext.row_linear(torch.randn(2, 16), w, torch.randn(9), 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.row_linear(torch.randn(16, 2).t(), w, None, 8)
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.row_linear(torch.randn(2, 16), torch.randn(8, 16), None, 8)
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.row_linear(torch.randn(2, 16), w, None, 40)
    assert ext.row_linear(torch.randn(0, 16), w, None, 8).shape == (0, 8)


def test_bf16_rejects_bad_arguments(ext):
    w = ext.pack_linear_weight_bf16(torch.randn(8, 16).bfloat16())
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        ext.row_linear_bf16(x.float(), w, None, 8)
    with pytest.raises(RuntimeError, match="bf16"):
        ext.pack_linear_weight_bf16(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        ext.row_linear_bf16(torch.randn(2, 13).bfloat16(), w, None, 8)
    with pytest.raises(RuntimeError, match="bias"):
        ext.row_linear_bf16(x, w, torch.randn(9), 8)
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.row_linear_bf16(x, w, None, 40)
    assert ext.row_linear_bf16(torch.randn(0, 16).bfloat16(), w, None, 8).shape == (0, 8)
    odd = torch.randn(5, 7).bfloat16()  # odd in_features: the pad pairs with a zero weight
    got = ext.row_linear_bf16(torch.randn(3, 7).bfloat16(), ext.pack_linear_weight_bf16(odd), None, 5)
    assert got.shape == (3, 5)


def test_wrapped_model_equals_unwrapped(ext):
    """A small Llama with a tied lm_head: logits for few rows and many equal the unwrapped model's
    within fp32 rounding; the tied weight stays one tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids_few, ids_many = torch.randint(300, (1, 5)), torch.randint(300, (1, 40))
    with torch.no_grad():
        want = [model(ids).logits for ids in (ids_few, ids_many)]
        assert wrap_linears(model, ext) == 2 * 7 + 1
        assert isinstance(model.lm_head, RowInvariantLinear)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        got = [model(ids).logits for ids in (ids_few, ids_many)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    empty = model.lm_head(torch.zeros(1, 0, 64))  # a step that needs no logits
    assert empty.shape == (1, 0, 300)


@pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX-BF16")
def test_amx_is_the_bf16_path_where_the_cpu_has_it(ext):
    """On an AMX machine row_linear_bf16 runs on tiles whenever in_features is a multiple of 32."""
    assert ext.linear_amx(576) and ext.linear_amx(4864) and not ext.linear_amx(100)


@pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 65, 200])
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (49, 896), (1152, 64)])
def test_amx_path_equals_the_avx512_path_within_a_rounding(ext, rows, out_f, in_f):
    """AMX tiles (the fast path) against the AVX-512 lanes (its reference): both add exact bf16 products
    in fp32 and round once, in different orders, so they agree to one bf16 rounding of the result
    plus the fp32 sums' error, and AMX is batch invariant (every row alone equals the row in the call)."""
    gen = torch.Generator().manual_seed(rows + in_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w, b = torch.randn(out_f, in_f, generator=gen).bfloat16(), torch.randn(out_f, generator=gen)
    packed = ext.pack_linear_weight_bf16(w)
    fast = ext.row_linear_bf16(x, packed, b, out_f)
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(ext.row_linear_bf16(x[r : r + 1].contiguous(), packed, b, out_f), fast[r : r + 1])
    with lanes_only(ext):
        reference = ext.row_linear_bf16(x, packed, b, out_f)
    sums = x.double().abs() @ w.double().abs().T
    bound = reference.double().abs() * 2**-7 + in_f * 2**-22 * sums + 1e-30
    assert ((fast.double() - reference.double()).abs() <= bound).all()


def amx_modes():
    return [True, False] if has_amx_bf16() else [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", amx_modes())
@pytest.mark.parametrize(
    "rows,in_f,inter,with_bias",
    [(1, 64, 48, False), (17, 96, 64, True), (70, 896, 160, True), (203, 97, 80, True)],
)
def test_glu_is_the_unfused_gate_up_and_activation(ext, dtype, amx, rows, in_f, inter, with_bias):
    """row_linear_glu (the fused forward's gate|up projection with silu(gate) * up, on AMX the GEMM's
    epilogue) against the same projection stored and torch's ops on it: equal to the rounding of the
    activation's own exp (bf16: one rounding of the result), and each row alone equals the row in
    the call."""
    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    gate, up = (torch.randn(inter, in_f, generator=gen).to(dtype) for _ in range(2))
    bias = torch.randn(2 * inter, generator=gen).to(dtype) if with_bias else None
    bf16 = dtype == torch.bfloat16
    pack = ext.pack_linear_weight_bf16 if bf16 else ext.pack_linear_weight
    packed = torch.cat([pack(gate), pack(up)])
    before = ext.set_amx(amx)
    try:
        both = (ext.row_linear_bf16 if bf16 else ext.row_linear)(x, packed, bias, 2 * inter)
        want = F.silu(both[:, :inter]) * both[:, inter:]
        got = ext.row_linear_glu(x, packed, bias, inter)
        for r in {0, rows // 2, rows - 1}:
            assert torch.equal(
                ext.row_linear_glu(x[r : r + 1].contiguous(), packed, bias, inter), got[r : r + 1]
            )
    finally:
        ext.set_amx(before)
    assert got.shape == (rows, inter) and got.dtype == dtype
    bound = want.double().abs() * (2**-7 if bf16 else 1e-6) + 1e-30
    assert ((got.double() - want.double()).abs() <= bound).all()


def test_glu_rejects_bad_arguments(ext):
    x = torch.randn(3, 32)
    packed = torch.cat([ext.pack_linear_weight(torch.randn(32, 32))] * 2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.row_linear_glu(x, packed, None, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.row_linear_glu(x, packed, None, 16)  # packed holds 2 x 32 outputs, not 2 x 16
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ext.row_linear_glu(x.half(), packed, None, 32)


@pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("out_f,in_f,limit", [(4096, 64, 4096), (1000, 576, 990), (40, 128, 33), (16, 64, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_head_argmax_is_argmax_rows_of_the_logits(ext, rows, out_f, in_f, limit, with_bias):
    """row_linear_bf16_argmax (a greedy step's LM head: the argmax in the AMX epilogue, no logits
    written) against its reference, argmax_rows over row_linear_bf16's logits: the same index for every
    row, exact ties (equal weight rows, an all-zero x) resolved to the first, a NaN row to its first NaN,
    and nothing at or past `limit` chosen."""
    gen = torch.Generator().manual_seed(rows * 7 + in_f)
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    if out_f > 8:
        w[5] = w[3]  # tie within a panel
    if out_f > 500:
        w[400] = w[3]  # ... and across panels and work items
    packed = ext.pack_linear_weight_bf16(w)
    b = torch.randn(out_f, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    if rows > 5:
        x[4] = 0  # every logit the bias (or 0): ties everywhere
    if rows > 7:
        x[6, 0] = float("nan")
    want = ext.argmax_rows(ext.row_linear_bf16(x, packed, b, out_f)[:, :limit].contiguous())
    assert torch.equal(ext.row_linear_bf16_argmax(x, packed, b, out_f, limit), want)

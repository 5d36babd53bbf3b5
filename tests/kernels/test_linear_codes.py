"""row_linear_codes (csrc/cpu/linear_codes.cpp): a linear over GGUF codes is bitwise row_linear over the
dequantized fp32 weight, for every row count (the few-row path reads codes in place, the many-row path
widens blocks of them), with the gated MLP's variant, and the model wrapper that routes to it.
row_linear_qcodes (csrc/cpu/linear_qcodes.cpp, models/code_layout.py): the same codes packed at their own
width unpack to the same weight and give row_linear_codes' outputs bitwise, for every GGUF type."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from kvserve.models.code_layout import CodeLayout, choose_layout, pack, super_factors
from kvserve.models.cpu_linear import RowInvariantLinear, packed_codes_pay, same_bits, wrap_linears
from kvserve.models.gguf_blocks import GROUPS, random_blocks
from kvserve.models.gguf_codes import Codes, codes_from_gguf, dequantize, regroup


def random_codes(out: int, n_in: int, group: int, seed: int = 0, offsets: bool = True) -> Codes:
    """Codes as a GGUF K-quant makes them: fp16 super-scale times small integer sub-scales (exact products),
    codes in [-32, 31], offsets of the same kind (or -0.0, as formats without one store)."""
    gen = torch.Generator().manual_seed(seed)
    groups = n_in // group
    codes = torch.randint(-32, 32, (out, n_in), generator=gen, dtype=torch.int8)
    d = (torch.rand(out, 1, generator=gen) * 0.01).half().float()
    scale = d * torch.randint(1, 64, (out, groups), generator=gen).float()
    if offsets:
        offset = -(d * torch.randint(0, 64, (out, groups), generator=gen).float())
    else:
        offset = torch.full((out, groups), -0.0)
    return Codes(codes, scale, offset)


def both(ext, c: Codes):
    """(codes packed, the dequantized weight packed for row_linear)"""
    return ext.pack_linear_codes(c.codes, c.scale, c.offset), ext.pack_linear_weight(dequantize(c))


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("offsets", [True, False])
def test_unpacked_codes_are_the_dequantized_weight_bitwise(ext, group, offsets):
    c = random_codes(37, 128, group, offsets=offsets)  # a partial last panel
    packed, dense = both(ext, c)
    assert same_bits(ext.unpack_linear_codes(packed, 128), dense)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 96, 200])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_row_linear_over_the_dequantized_weight_bitwise(ext, rows, group, with_bias):
    c = random_codes(100, 256, group, seed=rows)  # 100: a partial last panel
    packed, dense = both(ext, c)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 256, generator=gen)
    b = torch.randn(100, generator=gen) if with_bias else None
    assert same_bits(ext.row_linear_codes(x, packed, b, 100), ext.row_linear(x, dense, b, 100))


@pytest.mark.parametrize("rows", [1, 5, 16, 40, 130])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gated_mlp_over_codes_matches_the_dense_one_bitwise(ext, rows, with_bias):
    inter = 64
    c = random_codes(2 * inter, 192, 32, seed=rows)
    packed, dense = both(ext, c)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 192, generator=gen)
    b = torch.randn(2 * inter, generator=gen) if with_bias else None
    assert same_bits(ext.row_linear_glu(x, packed, b, inter), ext.row_linear_glu(x, dense, b, inter))


def test_a_row_is_the_same_whatever_the_rows_beside_it(ext):
    """Batch invariance across the two paths: a row alone (codes read in place) equals the same row in a
    prefill of 300 (blocks widened to fp32), bitwise."""
    c = random_codes(192, 320, 16, seed=3)
    packed = ext.pack_linear_codes(c.codes, c.scale, c.offset)
    x = torch.randn(300, 320, generator=torch.Generator().manual_seed(4))
    full = ext.row_linear_codes(x, packed, None, 192)
    for r in (0, 17, 299):
        assert same_bits(ext.row_linear_codes(x[r : r + 1].contiguous(), packed, None, 192), full[r : r + 1])
        assert same_bits(ext.row_linear_codes(x[r : r + 8].contiguous(), packed, None, 192), full[r : r + 8])


def test_splits_across_threads_with_the_same_result(ext):
    c = random_codes(3000, 256, 32, seed=5)
    packed = ext.pack_linear_codes(c.codes, c.scale, c.offset)
    x = torch.randn(130, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.row_linear_codes(x, packed, None, 3000)
        torch.set_num_threads(2)
        assert same_bits(ext.row_linear_codes(x, packed, None, 3000), one)
    finally:
        torch.set_num_threads(threads)


def test_rejects_bad_arguments(ext):
    c = random_codes(16, 64, 32)
    packed = ext.pack_linear_codes(c.codes, c.scale, c.offset)
    with pytest.raises(RuntimeError, match="not codes of 48 inputs"):
        ext.row_linear_codes(torch.randn(2, 48), packed, None, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.row_linear_codes(torch.randn(2, 64).bfloat16(), packed, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        ext.row_linear_codes(torch.randn(2, 64), packed, None, 40)
    with pytest.raises(RuntimeError, match="groups of 16 or 32"):
        ext.pack_linear_codes(c.codes, c.scale[:, :1].contiguous(), c.offset[:, :1].contiguous())


def test_regrouped_codes_are_the_same_weight(ext):
    c = random_codes(24, 96, 32, seed=6)
    r = regroup(c, 16)
    assert r.group == 16 and same_bits(dequantize(r), dequantize(c))
    x = torch.randn(3, 96)
    a = ext.row_linear_codes(x, ext.pack_linear_codes(c.codes, c.scale, c.offset), None, 24)
    b = ext.row_linear_codes(x, ext.pack_linear_codes(r.codes, r.scale, r.offset), None, 24)
    assert same_bits(a, b)


class TwoLayers(nn.Module):
    def __init__(self, c1: Codes, c2: Codes):
        super().__init__()
        self.up_proj = nn.Linear(c1.codes.shape[1], c1.codes.shape[0], bias=False)
        self.down_proj = nn.Linear(c2.codes.shape[1], c2.codes.shape[0], bias=True)
        with torch.no_grad():
            self.up_proj.weight.copy_(dequantize(c1))
            self.down_proj.weight.copy_(dequantize(c2))

    def forward(self, x):
        return self.down_proj(self.up_proj(x))


def test_wrap_linears_reads_codes_only_where_they_are_the_weight(ext):
    c1, c2 = random_codes(64, 32, 32, seed=7), random_codes(32, 64, 16, seed=8)
    plain, coded = TwoLayers(c1, c2), TwoLayers(c1, c2)
    coded.load_state_dict(plain.state_dict())
    wrap_linears(plain, ext)
    wrap_linears(coded, ext, {"up_proj": c1, "down_proj": c2})
    if packed_codes_pay(ext):  # packed at their width, each weight its own layout and group
        assert coded.up_proj.layout is not None and coded.up_proj.layout.group == 32
        assert coded.down_proj.layout is not None and coded.down_proj.layout.group == 16
    else:  # int8 codes, each call its own group
        assert coded.up_proj.layout is None and coded.up_proj.codes.group == 32
        assert coded.down_proj.codes.group == 16
    assert coded.up_proj.packed.dtype == torch.uint8 and coded.up_proj.lanes == plain.up_proj.lanes
    x = torch.randn(5, 32)
    assert same_bits(coded(x), plain(x))

    stale = TwoLayers(c1, c2)
    with torch.no_grad():
        stale.down_proj.weight[0, 0] += 1.0  # the codes no longer give this weight
    wrap_linears(stale, ext, {"up_proj": c1, "down_proj": c2})
    # every decoder projection or none: down_proj's codes are stale, so up_proj's go unused too
    assert stale.up_proj.codes is None and stale.down_proj.codes is None


def test_repack_refuses_codes_that_are_no_longer_the_weight(ext):
    c = random_codes(16, 32, 32, seed=9)
    linear = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(dequantize(c))
    wrapped = RowInvariantLinear(linear, ext, c)
    wrapped.repack()  # still the weight
    with torch.no_grad():
        linear.weight.mul_(2)
    with pytest.raises(ValueError, match="not this fp32 weight"):
        wrapped.repack()


def q8_codes(weight: torch.Tensor) -> Codes:
    """Q8_0 as GGUF makes it: per 32 inputs an fp16 d = amax / 127 and codes round(w / d)."""
    out, n_in = weight.shape
    blocks = weight.reshape(out, n_in // 32, 32)
    d = (blocks.abs().amax(dim=2) / 127).half().float().clamp_min(2**-14)
    codes = torch.round(blocks / d.unsqueeze(2)).clamp(-127, 127).to(torch.int8).reshape(out, n_in)
    return Codes(codes, d, torch.full_like(d, -0.0))


@pytest.fixture(scope="module")
def coded_model_dirs(tmp_path_factory):
    """tiny-random-qwen2 with its linears replaced by Q8_0 dequantized weights: one directory with their
    codes beside them, one without."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvserve.models.gguf_codes import CODES_FILE, FORMAT, LINEAR_MODULES
    from kvserve.models.loader import resolve_model_path

    source = resolve_model_path("tiny-random-qwen2")
    plain, coded = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("coded")
    weights = load_file(str(source / "model.safetensors"))
    codes = {}
    for name, w in weights.items():
        if w.dim() == 2 and name.endswith(".weight") and name[: -len(".weight")].endswith(LINEAR_MODULES):
            c = q8_codes(w)
            weights[name] = dequantize(c)
            codes.update({f"{name}.codes": c.codes, f"{name}.scale": c.scale, f"{name}.offset": c.offset})
    for d in (plain, coded):
        for f in source.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
        save_file(weights, str(d / "model.safetensors"))
    save_file(codes, str(coded / CODES_FILE), metadata={"format": FORMAT, "gguf": "q8 of tiny-random-qwen2"})
    return plain, coded


def test_an_engine_on_codes_is_the_engine_on_fp32_weights_bitwise(ext, coded_model_dirs):
    """The fused forward over codes (q|k|v, o, gate|up, down and the untied LM head) gives the fp32
    engine's tokens and logits bitwise, for prefills of several lengths and the decodes after them."""
    from kvserve import LLM, SamplingParams
    from tests.integration.helpers import corpus_token_ids, generate_with_logits

    plain, coded = (LLM(model=str(d), dtype="float32", max_cache_bytes=20_000_000) for d in coded_model_dirs)
    assert coded.engine.info.model_forward == "fused"
    heads = [m for m in coded.engine.model.modules() if isinstance(m, RowInvariantLinear)]
    assert heads and all(m.codes is not None for m in heads)  # every linear, the LM head included
    assert not any(
        m.codes is not None for m in plain.engine.model.modules() if isinstance(m, RowInvariantLinear)
    )
    prompts = [corpus_token_ids(plain, n, seed=n) for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    (want, want_logits), (got, got_logits) = (
        generate_with_logits(llm, prompts, params) for llm in (plain, coded)
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got_logits, want_logits, strict=True):
        assert same_bits(g, w)


# ---- row_linear_qcodes: codes packed at their own width ----------------------------------------------

# GGUF type -> (bits, factors) of the layout its codes take alone
LAYOUTS = {
    QT.Q8_0: (8, "f16"),
    QT.Q4_0: (4, "f16"),
    QT.Q4_1: (4, "f16"),
    QT.Q5_0: (5, "f16"),
    QT.Q5_1: (5, "f16"),
    QT.Q4_K: (4, "super"),
    QT.Q5_K: (5, "super"),
    QT.Q6_K: (6, "super"),
}
FEW_ROWS = 16  # linear_tiles.h kFewRows: more rows take the widened path


def gguf_codes(qtype: QT, out: int, n_in: int, seed: int = 0) -> Codes:
    return codes_from_gguf(random_blocks(qtype, out, n_in, seed), qtype)


def test_every_gguf_type_has_a_layout_case():
    assert set(LAYOUTS) == set(GROUPS)


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda t: t.name)
def test_packed_codes_are_the_dequantized_weight_bitwise(ext, qtype):
    c = gguf_codes(qtype, 40, 512)  # 40: a partial last panel
    layout = choose_layout([c])
    assert (layout.bits, layout.factors) == LAYOUTS[qtype]
    packed = pack(ext, c, layout)
    assert same_bits(ext.unpack_linear_qcodes(packed, 512), ext.pack_linear_weight(dequantize(c)))
    bytes_per_weight = ext.qcodes_bytes_per_weight(packed, 512)
    assert bytes_per_weight < layout.bits / 8 + 0.2  # the codes' bits, factors and a 64-byte header


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_K, QT.Q5_0], ids=lambda t: t.name)
def test_negative_block_scales_pack_exactly(ext, qtype):
    """llama.cpp writes Q6_K with d < 0 where a sub-block's largest weight is negative (sub-scales then
    reach -128, and D * s needs D < 0), and -0.0 weights where such a code is 0."""
    c = codes_from_gguf(random_blocks(qtype, 40, 512, seed=11, sign=-1.0), qtype)
    layout = choose_layout([c])
    assert layout.factors == LAYOUTS[qtype][1]
    packed = pack(ext, c, layout)
    assert same_bits(ext.unpack_linear_qcodes(packed, 512), ext.pack_linear_weight(dequantize(c)))


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda t: t.name)
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_codes_give_todays_outputs_bitwise(ext, qtype, with_bias):
    """Every row count of the few-row tiles (1 .. kFewRows), the first widened one and two more."""
    c = gguf_codes(qtype, 100, 512, seed=1)
    packed, today = pack(ext, c, choose_layout([c])), ext.pack_linear_codes(c.codes, c.scale, c.offset)
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(100, generator=gen) if with_bias else None
    for rows in [*range(1, FEW_ROWS + 2), 40, 130]:
        x = torch.randn(rows, 512, generator=gen)
        assert same_bits(ext.row_linear_qcodes(x, packed, b, 100), ext.row_linear_codes(x, today, b, 100)), (
            rows
        )


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_gated_mlp_over_packed_codes_gives_todays_outputs_bitwise(ext, qtype):
    inter = 96
    c = gguf_codes(qtype, 2 * inter, 256, seed=3)
    packed, today = pack(ext, c, choose_layout([c])), ext.pack_linear_codes(c.codes, c.scale, c.offset)
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(2 * inter, generator=gen)
    for rows in [1, 2, 5, 8, FEW_ROWS, FEW_ROWS + 1, 130]:
        x = torch.randn(rows, 256, generator=gen)
        want = ext.row_linear_glu(x, today, b, inter)
        assert same_bits(ext.row_linear_glu_qcodes(x, packed, b, inter), want), rows


def test_weights_of_different_types_share_a_layout_and_concatenate(ext):
    """q|k|v as Qwen's GGUF has them (Q5_0 q and k, a Q8_0 v): one layout (8 bits), rows concatenated."""
    parts = [
        gguf_codes(QT.Q5_0, 64, 256, 5),
        gguf_codes(QT.Q5_0, 32, 256, 6),
        gguf_codes(QT.Q8_0, 32, 256, 7),
    ]
    layout = choose_layout(parts)
    assert (layout.bits, layout.zero, layout.factors) == (8, 0, "f16")
    packed = torch.cat([pack(ext, c, layout) for c in parts])
    dense = torch.cat([ext.pack_linear_weight(dequantize(c)) for c in parts])
    x = torch.randn(3, 256)
    assert same_bits(ext.row_linear_qcodes(x, packed, None, 128), ext.row_linear(x, dense, None, 128))
    q41 = gguf_codes(QT.Q4_1, 32, 256, 8)  # two layouts of one row size: 5 bits from 0 and from -8
    mixed = torch.cat([pack(ext, q41, CodeLayout(5, zero, 32, "f16", True)) for zero in (0, -8)])
    with pytest.raises(RuntimeError, match="different formats"):
        ext.row_linear_qcodes(x, mixed, None, 64)


def test_factors_without_an_exact_compact_form_stay_fp32(ext):
    c = random_codes(40, 256, 32, seed=8)
    # 17-bit scales (their products with the codes still exact): not fp16, no common factor times int8
    scale = torch.randint(2**16, 2**17, c.scale.shape, generator=torch.Generator().manual_seed(9)) * 2.0**-20
    odd = Codes(c.codes, scale, c.offset)
    assert super_factors(scale, 8) is None
    layout = choose_layout([odd])
    assert layout.factors == "f32" and layout.offsets
    packed = pack(ext, odd, layout)
    assert same_bits(ext.unpack_linear_qcodes(packed, 256), ext.pack_linear_weight(dequantize(odd)))


def test_super_factors_keep_the_sign_of_zero():
    """-(dmin * 0) is -0.0: a super-block with a -0.0 (or only values <= 0) gets a negative factor."""
    o = torch.tensor([[-0.0, -0.25, -0.5, -0.0], [0.0, 0.25, 0.75, 0.0]])
    big, small = super_factors(o, 4)
    assert same_bits(big.repeat_interleave(4, dim=1) * small.float(), o)
    big, small = super_factors(torch.tensor([[-0.0, 0.25]]), 2)  # -0.0 beside a positive: D < 0
    assert big.item() == -0.25 and small.tolist() == [[0, -1]]
    assert super_factors(torch.tensor([[-0.0, 0.0]]), 2) is None  # both zeros: no one D gives them
    # all negative down to -128 x D (Q6_K in Qwen's GGUF): D > 0, as D < 0 would need s = 128
    d = 2.0**-10
    values = torch.tensor([[-128 * d, -100 * d, -5 * d, -77 * d]])
    big, small = super_factors(values, 4)
    assert big.item() == d and small.tolist() == [[-128, -100, -5, -77]]


def test_packed_codes_split_across_threads_with_the_same_result(ext):
    c = gguf_codes(QT.Q4_K, 3000, 256, seed=9)
    packed = pack(ext, c, choose_layout([c]))
    threads = torch.get_num_threads()
    try:
        for rows in (3, 130):
            x = torch.randn(rows, 256)
            torch.set_num_threads(1)
            one = ext.row_linear_qcodes(x, packed, None, 3000)
            torch.set_num_threads(2)
            assert same_bits(ext.row_linear_qcodes(x, packed, None, 3000), one)
    finally:
        torch.set_num_threads(threads)


def test_packed_codes_reject_bad_arguments(ext):
    c = gguf_codes(QT.Q5_0, 16, 64)
    packed = pack(ext, c, choose_layout([c]))
    with pytest.raises(RuntimeError, match="of 64 inputs, x has 48"):
        ext.row_linear_qcodes(torch.randn(2, 48), packed, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        ext.row_linear_qcodes(torch.randn(2, 64), packed, None, 40)
    with pytest.raises(RuntimeError, match="do not fit in 4 bits"):
        pack(ext, c, CodeLayout(4, -16, 32, "f16", False))


def test_the_smollm2_gguf_packs_to_its_weights(ext):
    """The default model's own GGUF (Q4_1 projections, a Q8_0 token_embd: its tied LM head), where installed."""
    from gguf import GGUFReader

    from kvserve.errors import ModelNotFoundError
    from kvserve.models.loader import _smollm2_gguf

    try:
        path = _smollm2_gguf()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name, rows in (("blk.0.ffn_gate.weight", 1536), ("token_embd.weight", 4096)):
        t = tensors[name]
        c = codes_from_gguf(t.data[:rows], QT(t.tensor_type))
        packed = pack(ext, c, choose_layout([c]))
        n_in = c.codes.shape[1]
        assert same_bits(ext.unpack_linear_qcodes(packed, n_in), ext.pack_linear_weight(dequantize(c)))


class TiedHead(nn.Module):
    """model.embed_tokens and an lm_head sharing its weight, as a tied HF causal LM has them."""

    def __init__(self, c: Codes):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(*c.codes.shape)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(dequantize(c))
        self.lm_head = nn.Linear(c.codes.shape[1], c.codes.shape[0], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_a_tied_head_reads_the_embeddings_codes(ext):
    c = gguf_codes(QT.Q8_0, 100, 64, seed=12)
    plain, tied = TiedHead(c), TiedHead(c)
    wrap_linears(plain, ext)
    wrap_linears(tied, ext, {"model.embed_tokens": c})
    assert tied.lm_head.codes is not None and same_bits(dequantize(tied.lm_head.codes), dequantize(c))
    assert tied.lm_head.layout is None or tied.lm_head.layout.bits == 8
    x = torch.randn(3, 64)
    assert same_bits(tied.lm_head(x), plain.lm_head(x))

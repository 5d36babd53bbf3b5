"""GGUF codes (kvserve/models/gguf_codes.py): the int8 codes, per-group scales and offsets of a GGUF's
linear weights reproduce gguf's own dequantization bit for bit (the sign of zeros included), and
write_codes keeps exactly the tensors that reproduce the converted fp32 weights, after the row
permutation transformers applies to llama's q/k."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvserve.models import gguf_codes
from kvserve.models.gguf_blocks import F16_FIELDS, GROUPS, unpack
from kvserve.models.gguf_codes import (
    CODES_FILE,
    FORMAT,
    TIED_HEAD_KEY,
    Codes,
    codes_from_gguf,
    dequantize,
    lacks_tied_head,
    llama_row_permutation,
    load_codes,
    regroup,
    write_codes,
)

QUANTIZABLE = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]  # gguf.quants.quantize has these
ALL = [*QUANTIZABLE, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, n_in: int) -> np.ndarray:
    """Random raw blocks [rows, bytes] whose fp16 fields are finite, small (subnormals among them), and
    now and then +0.0 or -0.0."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_in // block
    raw = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        v = rng.uniform(-0.01, 0.01, (rows, n_blocks)).astype(np.float16)
        v[rng.random(v.shape) < 0.05] = 0.0
        v[rng.random(v.shape) < 0.05] = -0.0
        raw[..., off : off + 2] = v.view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * size)


def bits(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    return t.contiguous().view(torch.int32)


def assert_reproduces(raw: np.ndarray, qtype: QT) -> Codes:
    want = gguf.quants.dequantize(raw, qtype)
    c = codes_from_gguf(raw, qtype)
    rows, n_in = want.shape
    assert c.codes.shape == (rows, n_in) and c.codes.dtype == torch.int8
    assert c.group == GROUPS[qtype] and c.scale.shape == (rows, n_in // c.group) == c.offset.shape
    got = dequantize(c)
    assert torch.equal(bits(got), bits(want)), f"{qtype.name}: {(bits(got) != bits(want)).float().mean():.3g}"
    # the claim that makes multiply-then-add the fused multiply-add: scale * code is exact in float32
    scale = c.scale.repeat_interleave(c.group, dim=1)
    offset = c.offset.repeat_interleave(c.group, dim=1)
    product = scale * c.codes.float()
    assert torch.equal(product.double(), scale.double() * c.codes.double())
    assert torch.equal(bits(torch.addcmul(offset, scale, c.codes.float())), bits(got))
    return c


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_matrix_codes_reproduce_gguf_dequantize_bitwise(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.001, 1.0, (64, 1))).astype(np.float32)
    x[:4] = 0.0  # all-zero blocks: d = 0
    x[4, :32] = -0.0  # a block of negative zeros
    raw = gguf.quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (64, 256 // 32 * GGML_QUANT_SIZES[qtype][1])
    assert_reproduces(raw, qtype)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_block_codes_reproduce_gguf_dequantize_bitwise(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw = random_blocks(rng, qtype, 64, 512)
    c = assert_reproduces(raw, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    if qtype in (QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q6_K):  # offset -0.0: the sign of a zero product survives
        assert (np.signbit(want) & (want == 0)).any() and (~np.signbit(want) & (want == 0)).any()
        assert bool((c.offset == 0).all()) and bool(torch.signbit(c.offset).all())
    lo, hi = {
        QT.Q8_0: (-128, 127),
        QT.Q4_0: (-8, 7),
        QT.Q5_0: (-16, 15),
        QT.Q4_1: (0, 15),
        QT.Q5_1: (0, 31),
        QT.Q4_K: (0, 15),
        QT.Q5_K: (0, 31),
        QT.Q6_K: (-32, 31),
    }[qtype]
    assert int(c.codes.min()) == lo and int(c.codes.max()) == hi


def test_unpacking_in_row_chunks_changes_nothing(monkeypatch):
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, QT.Q5_0, 37, 256)
    whole = unpack(raw, QT.Q5_0)
    monkeypatch.setattr(gguf_codes, "_CHUNK", 300)  # one row (256 elements) a chunk
    for a, b in zip(whole, unpack(raw, QT.Q5_0)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_types_without_codes_are_refused():
    with pytest.raises(ValueError, match="F16 has no codes"):
        unpack(np.zeros((2, 64), dtype=np.uint8), QT.F16)
    with pytest.raises(ValueError, match="Q8_0 data"):
        unpack(np.zeros((2, 33), dtype=np.uint8), QT.Q8_0)


def test_regroup_keeps_the_weight():
    rng = np.random.default_rng(3)
    c = codes_from_gguf(random_blocks(rng, QT.Q4_K, 8, 256), QT.Q4_K)
    assert c.group == 32
    for g in (32, 16, 8, 1):
        r = regroup(c, g)
        assert r.group == g and r.scale.shape == (8, 256 // g)
        assert torch.equal(bits(dequantize(r)), bits(dequantize(c)))
    for g in (0, 12, 64):
        with pytest.raises(ValueError):
            regroup(c, g)


def test_codes_check_their_shapes():
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError):
        Codes(codes.float().to(torch.int16), torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError):
        Codes(codes, torch.zeros(4, 3), torch.zeros(4, 3))  # 3 groups do not divide 64
    with pytest.raises(ValueError):
        Codes(codes, torch.zeros(4, 2), torch.zeros(4, 4))
    assert Codes(codes, torch.zeros(4, 4), torch.zeros(4, 4)).group == 16


def test_llama_row_permutation_is_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    for n_head in (1, 2, 3, 6):
        want = LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_head)
        assert np.array_equal(w[llama_row_permutation(24, n_head)], want)


# ---- write_codes / load_codes on a tiny llama-arch GGUF and its "converted" model ---------------------

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 512, 64
LAYER = {  # HF module -> (GGUF tensor, type, [out, in])
    "self_attn.q_proj": ("attn_q", QT.Q4_1, (HIDDEN, HIDDEN)),
    "self_attn.k_proj": ("attn_k", QT.Q5_0, (KV_HEADS * HIDDEN // HEADS, HIDDEN)),
    "self_attn.v_proj": ("attn_v", QT.Q8_0, (KV_HEADS * HIDDEN // HEADS, HIDDEN)),
    "self_attn.o_proj": ("attn_output", QT.Q4_0, (HIDDEN, HIDDEN)),
    "mlp.gate_proj": ("ffn_gate", QT.Q5_1, (INTER, HIDDEN)),
    "mlp.up_proj": ("ffn_up", QT.Q4_K, (INTER, HIDDEN)),
    "mlp.down_proj": ("ffn_down", QT.Q6_K, (HIDDEN, INTER)),
}
CORRUPTED = "model.layers.1.mlp.up_proj.weight"
UNQUANTIZED = "model.layers.1.self_attn.o_proj.weight"  # F16 in the GGUF: no codes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(GGUF path, model dir, {HF weight name: the stored fp32 weight}) as _convert_gguf_into would
    leave them: every weight gguf's dequantization, llama's q/k rows reverse-permuted by transformers'
    own code; one weight corrupted by one bit, one linear stored F16."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    root = tmp_path_factory.mktemp("gguf_codes")
    rng = np.random.default_rng(0)
    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    writer = gguf.GGUFWriter(root / "tiny.gguf", arch="llama")
    writer.add_block_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    stored: dict[str, torch.Tensor] = {}

    def add(hf: str, name: str, qtype: QT, shape: tuple[int, int]) -> None:
        if qtype == QT.F16:
            half = rng.standard_normal(shape).astype(np.float16)
            writer.add_tensor(name, half)
            w = half.astype(np.float32)
        else:
            raw = random_blocks(rng, qtype, *shape)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            w = processor.process(weights=gguf.quants.dequantize(raw, qtype), name=name).weights
        stored[hf] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    add("model.embed_tokens.weight", "token_embd.weight", QT.Q8_0, (VOCAB, HIDDEN))
    for layer in range(2):
        for module, (name, qtype, shape) in LAYER.items():
            hf = f"model.layers.{layer}.{module}.weight"
            if layer == 1 and module == "mlp.down_proj":
                qtype = QT.Q5_K
            add(hf, f"blk.{layer}.{name}.weight", QT.F16 if hf == UNQUANTIZED else qtype, shape)
        norm = np.ones(HIDDEN, dtype=np.float32)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        stored[f"model.layers.{layer}.input_layernorm.weight"] = torch.from_numpy(norm)
    add("lm_head.weight", "output.weight", QT.Q8_0, (VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    stored[CORRUPTED].view(torch.int32)[3, 5] ^= 1  # one bit of one element
    model_dir = root / "model"
    model_dir.mkdir()
    save_file(stored, model_dir / "model.safetensors", metadata={"format": "pt"})
    return root / "tiny.gguf", model_dir, stored


@pytest.fixture(scope="module")
def written(tiny):
    gguf_path, model_dir, stored = tiny
    return write_codes(gguf_path, model_dir), model_dir, stored


def test_write_codes_keeps_every_verified_linear_weight(written):
    path, model_dir, stored = written
    assert path == model_dir / CODES_FILE
    assert sorted(p.name for p in model_dir.iterdir()) == [CODES_FILE, "model.safetensors"]  # no temporaries
    # loaders that take every *.safetensors of a directory (vLLM) see only the weights
    assert [p.name for p in model_dir.glob("*.safetensors")] == ["model.safetensors"]
    codes = load_codes(model_dir)
    linear = {n[: -len(".weight")] for n in stored if gguf_codes._is_linear(n)}
    assert set(codes) == linear - {CORRUPTED[: -len(".weight")], UNQUANTIZED[: -len(".weight")]}
    assert "lm_head" in codes and "model.embed_tokens" not in codes
    for module, c in codes.items():
        assert torch.equal(bits(dequantize(c)), bits(stored[module + ".weight"])), module
    assert codes["model.layers.0.mlp.down_proj"].group == 16  # Q6_K
    assert codes["model.layers.1.mlp.down_proj"].group == 32  # Q5_K
    assert codes["model.layers.0.self_attn.q_proj"].codes.shape == (HIDDEN, HIDDEN)


def test_q_and_k_codes_carry_transformers_row_permutation(tiny, written):
    gguf_path, _, _ = tiny
    _, model_dir, _ = written
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    codes = load_codes(model_dir)
    for leaf, name, n_head in (("q_proj", "attn_q", HEADS), ("k_proj", "attn_k", KV_HEADS)):
        t = tensors[f"blk.0.{name}.weight"]
        raw = codes_from_gguf(t.data, t.tensor_type)
        perm = torch.from_numpy(llama_row_permutation(raw.codes.shape[0], n_head))
        c = codes[f"model.layers.0.self_attn.{leaf}"]
        assert torch.equal(c.codes, raw.codes[perm]) and not torch.equal(c.codes, raw.codes)
        assert torch.equal(bits(c.scale), bits(raw.scale[perm]))
    t = tensors["blk.0.attn_v.weight"]
    assert torch.equal(
        codes["model.layers.0.self_attn.v_proj"].codes, codes_from_gguf(t.data, t.tensor_type).codes
    )


def test_a_weight_that_does_not_verify_is_logged_and_left_out(tiny, tmp_path, caplog):
    gguf_path, model_dir, _ = tiny
    (tmp_path / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="kvserve.models"):
        write_codes(gguf_path, tmp_path)
    [record] = [r for r in caplog.records if CORRUPTED in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert f"{1 / (LAYER['mlp.up_proj'][2][0] * HIDDEN):.6g}" in record.getMessage()  # the fraction
    assert not any(UNQUANTIZED in r.getMessage() for r in caplog.records)  # no codes is no warning


def test_the_file_is_plain_safetensors_with_the_format_in_its_metadata(tiny, written):
    gguf_path, _, _ = tiny
    path, _, stored = written
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": FORMAT, "gguf": gguf_path.name, TIED_HEAD_KEY: "False"}
    tensors = load_file(path)  # the reference reader accepts the streamed layout
    c = tensors["model.layers.0.mlp.down_proj.weight.codes"]
    assert c.dtype == torch.int8 and c.shape == (HIDDEN, INTER)
    assert tensors["model.layers.0.mlp.down_proj.weight.scale"].shape == (HIDDEN, INTER // 16)
    assert tensors["lm_head.weight.offset"].dtype == torch.float32
    assert len(tensors) == 3 * (len(load_codes(path.parent)))


def test_a_tied_head_gets_the_embeddings_codes_once(tiny, tmp_path):
    """No lm_head.weight (tied to the embedding): the embedding's codes are kept, and a file written
    before kvserve kept them is found out (lacks_tied_head), so the loader writes it again."""
    gguf_path, _, stored = tiny
    tied = {n: w for n, w in stored.items() if n != "lm_head.weight"}
    save_file(tied, tmp_path / "model.safetensors", metadata={"format": "pt"})
    old = {k: v for k, v in load_file(write_codes(gguf_path, tmp_path)).items() if "embed" not in k}
    save_file(old, tmp_path / CODES_FILE, metadata={"format": FORMAT, "gguf": gguf_path.name})  # as before
    assert lacks_tied_head(tmp_path)
    write_codes(gguf_path, tmp_path)
    assert not lacks_tied_head(tmp_path)
    c = load_codes(tmp_path)["model.embed_tokens"]
    assert torch.equal(bits(dequantize(c)), bits(stored["model.embed_tokens.weight"]))


def test_load_codes_without_a_file_or_with_another_format(tmp_path):
    assert load_codes(tmp_path) == {}
    t = {"x.weight.codes": torch.zeros(2, 32, dtype=torch.int8)}
    t |= {"x.weight.scale": torch.zeros(2, 1), "x.weight.offset": torch.zeros(2, 1)}
    save_file(t, tmp_path / CODES_FILE, metadata={"format": "something-else"})
    assert load_codes(tmp_path) == {}
    save_file(t, tmp_path / CODES_FILE, metadata={"format": FORMAT})
    assert set(load_codes(tmp_path)) == {"x"}


def test_nothing_verified_writes_nothing_and_removes_a_stale_file(tiny, tmp_path):
    gguf_path, _, stored = tiny
    save_file(
        {UNQUANTIZED: stored[UNQUANTIZED], CORRUPTED: stored[CORRUPTED]}, tmp_path / "model.safetensors"
    )
    (tmp_path / CODES_FILE).write_bytes(b"stale")
    assert write_codes(gguf_path, tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert write_codes(gguf_path, tmp_path / "missing") is None

"""LayerKV.kernel_view: each storage describes what kernels read of it in place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvserve.kernels.paged_kv import PagedKV as ReexportedPagedKV
from kvserve.kernels.paged_kv import paged_kv
from kvserve.kvcache.kernel_view import PagedKV
from kvserve.kvcache.kv_storage import DenseLayerKV
from kvserve.kvcache.quantized_storage import QuantizedLayerKV, create_layer_kv
from kvserve.quant.registry import CODEC_NAMES, PASSTHROUGH_DTYPES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROOT = Path(__file__).resolve().parents[2] / "kvserve"


def _expected(codec: str, compute: torch.dtype, query: torch.dtype | None) -> str | None:
    """The format kernels read in place, or None (a dense copy)."""
    if codec == "auto" or PASSTHROUGH_DTYPES.get(codec) == compute:
        return "dense"  # DenseLayerKV, in the compute dtype
    if codec in PASSTHROUGH_DTYPES:
        return "dense" if query in (None, PASSTHROUGH_DTYPES[codec]) else None
    if codec in ("fp8_e4m3", "mxfp4"):
        return codec
    if codec == "int8":
        return "int8" if query in (None, compute) else None  # its open-K shadows are in compute
    return None


@pytest.mark.parametrize("compute", DTYPES)
@pytest.mark.parametrize("codec", ("auto", *CODEC_NAMES))
def test_kernel_view_per_format(codec, compute):
    kv = create_layer_kv(codec, 4, 16, 2, 64, compute)
    kv.write(torch.arange(20), torch.randn(20, 2, 64), torch.randn(20, 2, 64))  # one block open
    for query in (None, *DTYPES):
        view = kv.kernel_view(query)
        delegated = paged_kv(kv, query)  # the kernels' entry point
        assert (delegated is None) == (view is None)
        if view is not None and delegated is not None:
            assert all(getattr(delegated, f) is getattr(view, f) for f in view.extras())
            assert delegated.k_cache is view.k_cache and delegated.kv_format == view.kv_format
        assert (view.kv_format if view else None) == _expected(codec, compute, query), query
        if view is None:
            continue
        if isinstance(kv, DenseLayerKV):
            assert view.k_cache is kv.k_cache and view.v_cache is kv.v_cache
            continue
        assert isinstance(kv, QuantizedLayerKV)
        k, v = kv.k_blocks.fields, kv.v_blocks.fields
        if view.kv_format == "dense":
            assert view.k_cache is k["x"] and view.v_cache is v["x"] and view.k_scale is None
        else:  # the codes and scales themselves, not copies
            assert view.k_cache is k["codes"] and view.v_cache is v["codes"]
            assert view.k_scale is k["scale"] and view.v_scale is v["scale"]
        if view.kv_format == "int8":
            assert view.k_zero is k["zero"] and view.v_zero is v["zero"]
            assert view.k_open is kv.open_k.pool and view.k_open_slot is kv.open_k.slot_of_block
        else:
            assert view.k_zero is None and view.k_open is None and view.k_open_slot is None


def test_int8_view_follows_the_shadow_pool_as_it_grows():
    kv = create_layer_kv("int8", 12, 16, 2, 64, torch.float32)
    before = kv.kernel_view()
    for b in range(6):  # six open blocks: the shadow tensor is replaced (4 -> 8 rows)
        kv.write(torch.tensor([b * 16]), torch.randn(1, 2, 64), torch.randn(1, 2, 64))
    after = kv.kernel_view()
    assert before is not None and after is not None
    assert after.k_open is kv.open_k.pool and after.k_open is not before.k_open
    assert after.k_open.shape[0] == 8


def test_pagedkv_is_reexported_and_storage_does_not_import_kernels():
    assert ReexportedPagedKV is PagedKV
    for package in ("kvcache", "quant"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                assert not [n for n in names if n.startswith("kvserve.kernels")], path

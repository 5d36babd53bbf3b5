"""A cached chunk's KV as bytes and back: the payload the disk and Redis tiers store.

`export_chunk(layers, block_ids)` copies the blocks of a chunk out of every layer's storage, exactly
as stored (packed codes, scales, norms: no decode, no re-encode); `import_chunk(layers, block_ids,
payload)` writes them into other, already allocated blocks, which then read back bitwise as the
exported ones did. The layout, little-endian:

    magic b"KVCP" | version u16 | header_len u32 | header (JSON, utf-8) | body

    header = {"num_blocks": n, "formats": [format, ...], "layers": [format index per layer]}
    format = {"storage": "dense" | codec name, "fields": [[name, dtype, one block's shape], ...]}
    body   = for each layer, for each field in its format's order: the raw bytes of the
             [n, *shape] tensor, C order

Every layer of a model stores its blocks alike, so a format is written once and the header costs a
few hundred bytes whatever the number of layers (safetensors, also a dependency, repeats dtype,
shape and offsets per tensor: layers x fields entries). The body is exactly
sum(layer.bytes_per_block()) x n bytes.

The payload carries no checksum: the tier entry around it does (tiers/). `import_chunk`
checks everything it can about fit (version, block count, layer count, each layer's format against
the target's, exact body length) before writing anything, and raises `ChunkPayloadError` otherwise;
a rejected payload leaves the pool untouched.
"""

from __future__ import annotations

import json
import struct
import warnings

import torch

from kvserve.kvcache.kv_storage import BlockFields, LayerKV

MAGIC = b"KVCP"
VERSION = 1
_PRELUDE = struct.Struct("<4sHI")  # magic, version, header length in bytes
BODY_ALIGN = 16


class ChunkPayloadError(ValueError):
    """A payload that does not fit the target layers (other model, codec or block size; another
    format version; truncated or padded). The caller drops it and recomputes the chunk."""


def _format_of(layer: LayerKV) -> dict:
    """A layer's storage format, JSON-ready: what a payload's layer must match to import into it."""
    fields = layer.block_fields()
    return {
        "storage": layer.storage_format(),
        "fields": [
            [name, str(dtype).removeprefix("torch."), list(shape)] for name, (shape, dtype) in fields.items()
        ],
    }


def _field_bytes(fields: BlockFields, num_blocks: int) -> list[int]:
    """Bytes of each field's [num_blocks, *shape] tensor, in field order."""
    return [
        num_blocks * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in fields.values()
    ]


def export_chunk(
    layers: list[LayerKV],
    block_ids: list[int],
    layout: ChunkLayout | None = None,
    layer_block_ids: list[list[int]] | None = None,
) -> bytes:
    """The blocks `block_ids` of every layer (or each layer's own, `layer_block_ids`: layer groups of
    sliding-window models, kvcache/layout.py), as stored, in the layout above. The blocks must be
    complete (LayerKV.export_blocks). `layout` (for these layers and this many blocks) saves
    describing the layers again."""
    assert layers and block_ids, "export of no layers or no blocks"
    layout = layout or ChunkLayout(layers, len(block_ids))
    assert layout.num_blocks == len(block_ids) and layout.num_layers == len(layers)
    per_layer = layer_block_ids or [block_ids] * len(layers)
    assert all(len(ids) == len(block_ids) for ids in per_layer)
    parts: list[torch.Tensor] = []  # uint8 views of every field, in body order
    for layer, fields, ids in zip(layers, layout.fields, per_layer, strict=True):
        exported = layer.export_blocks(ids)
        assert list(exported) == list(fields), "export_blocks out of block_fields order"
        parts.extend(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in exported.values())
    return layout.prelude_and_header + torch.cat(parts).numpy().tobytes()


def _read_header(payload: bytes | memoryview) -> tuple[dict, int]:
    """(header, offset of the body); raises ChunkPayloadError for anything that is not a header of
    this version."""
    if len(payload) < _PRELUDE.size:
        raise ChunkPayloadError(
            f"payload of {len(payload)} bytes is shorter than its {_PRELUDE.size}-byte prelude"
        )
    magic, version, header_len = _PRELUDE.unpack_from(payload)
    if magic != MAGIC:
        raise ChunkPayloadError(f"not a chunk payload (magic {magic!r}, want {MAGIC!r})")
    if version != VERSION:
        raise ChunkPayloadError(
            f"chunk payload format version {version}; this kvserve reads {VERSION}: recompute"
        )
    body_offset = _PRELUDE.size + header_len
    if len(payload) < body_offset:
        raise ChunkPayloadError(
            f"payload truncated inside its header ({len(payload)} of {body_offset}+ bytes)"
        )
    try:
        header = json.loads(bytes(payload[_PRELUDE.size : body_offset]))
        ok = isinstance(header["num_blocks"], int) and isinstance(header["formats"], list)
        ok = ok and all(isinstance(i, int) and 0 <= i < len(header["formats"]) for i in header["layers"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkPayloadError(f"unreadable chunk payload header: {exc}") from exc
    if not ok:
        raise ChunkPayloadError("malformed chunk payload header")
    return header, body_offset


class ChunkLayout:
    """What a payload for `num_blocks` blocks of `layers` must look like, computed once per engine:
    the header `export_chunk` writes for them (a payload whose header is exactly this skips parsing
    and comparing it) and each layer's field sizes."""

    def __init__(self, layers: list[LayerKV], num_blocks: int):
        self.num_blocks, self.num_layers = num_blocks, len(layers)
        self.formats = [_format_of(layer) for layer in layers]
        self.fields = [layer.block_fields() for layer in layers]
        self.sizes = [_field_bytes(fields, num_blocks) for fields in self.fields]
        self.body_len = sum(sum(sizes) for sizes in self.sizes)
        self.prelude_and_header = _header(self.formats, num_blocks)


def _header(formats: list[dict], num_blocks: int) -> bytes:
    """Prelude and header of a payload of `num_blocks` blocks of layers stored as `formats`."""
    distinct: list[dict] = []
    for fmt in formats:
        if fmt not in distinct:
            distinct.append(fmt)
    header = {"num_blocks": num_blocks, "formats": distinct, "layers": [distinct.index(f) for f in formats]}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # pad with spaces (still JSON) so the body starts 16-byte aligned: a payload in a fresh bytes
    # object then yields aligned fields that need no copy before import (parse_chunk)
    header_bytes += b" " * (-(_PRELUDE.size + len(header_bytes)) % BODY_ALIGN)
    return _PRELUDE.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes


def _check(layout: ChunkLayout, payload: bytes | memoryview) -> int:
    expected = layout.prelude_and_header
    if payload[: len(expected)] == expected and len(payload) == len(expected) + layout.body_len:
        return len(expected)  # exactly what export_chunk writes for these layers
    header, body_offset = _read_header(payload)
    if header["num_blocks"] != layout.num_blocks:
        raise ChunkPayloadError(
            f"payload holds {header['num_blocks']} blocks, target has {layout.num_blocks}"
        )
    if len(header["layers"]) != layout.num_layers:
        raise ChunkPayloadError(
            f"payload holds {len(header['layers'])} layers, target model has {layout.num_layers}"
        )
    for idx, (want, fmt_idx) in enumerate(zip(layout.formats, header["layers"], strict=True)):
        got = header["formats"][fmt_idx]
        if got != want:
            raise ChunkPayloadError(f"layer {idx}: payload stores {got}, target stores {want}")
    if len(payload) - body_offset != layout.body_len:
        raise ChunkPayloadError(
            f"payload body has {len(payload) - body_offset} bytes, its layout needs {layout.body_len}"
        )
    return body_offset


def parse_chunk(layout: ChunkLayout, payload: bytes | memoryview) -> list[dict[str, torch.Tensor]]:
    """Check `payload` against `layout` (ChunkPayloadError otherwise) and return, per layer, its
    fields as tensors [num_blocks, *shape] that `LayerKV.import_blocks` takes: views of `payload`
    where a field is aligned for its dtype (it keeps `payload` alive), else copies. Touches no
    storage: any thread may parse while the engine's thread runs."""
    offset = _check(layout, payload)
    layers: list[dict[str, torch.Tensor]] = []
    with warnings.catch_warnings():  # torch cannot mark a view of bytes read only; nothing writes it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(payload, dtype=torch.uint8)
    for fields, sizes in zip(layout.fields, layout.sizes, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for (name, (shape, dtype)), size in zip(fields.items(), sizes, strict=True):
            raw = whole[offset : offset + size]
            if raw.data_ptr() % raw.new_empty((), dtype=dtype).element_size():
                raw = raw.clone()  # owns aligned memory: viewable as dtype
            tensors[name] = raw.view(dtype).reshape(layout.num_blocks, *shape)
            offset += size
        layers.append(tensors)
    return layers


def import_chunk(layers: list[LayerKV], block_ids: list[int], payload: bytes) -> None:
    """Write an `export_chunk` payload into the already allocated blocks `block_ids` of `layers`
    (the same model and storage, in the same layer order). Checks the whole payload first: on
    ChunkPayloadError nothing was written."""
    parsed = parse_chunk(ChunkLayout(layers, len(block_ids)), payload)
    for layer, fields in zip(layers, parsed, strict=True):
        layer.import_blocks(block_ids, fields)

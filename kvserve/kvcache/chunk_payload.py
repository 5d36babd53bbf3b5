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

The payload carries no checksum: the tier entry around it does (kvcache/tiers/). `import_chunk`
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


def export_chunk(layers: list[LayerKV], block_ids: list[int]) -> bytes:
    """The blocks `block_ids` of every layer, as stored, in the layout above. The blocks must be
    complete (LayerKV.export_blocks)."""
    assert layers and block_ids, "export of no layers or no blocks"
    formats: list[dict] = []
    layer_format: list[int] = []
    parts: list[torch.Tensor] = []  # uint8 views of every field, in body order
    for layer in layers:
        fmt = _format_of(layer)
        if fmt not in formats:
            formats.append(fmt)
        layer_format.append(formats.index(fmt))
        exported = layer.export_blocks(block_ids)
        assert list(exported) == list(layer.block_fields()), "export_blocks out of block_fields order"
        parts.extend(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in exported.values())
    header = {"num_blocks": len(block_ids), "formats": formats, "layers": layer_format}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    body = torch.cat(parts).numpy().tobytes()
    return _PRELUDE.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes + body


def _read_header(payload: bytes) -> tuple[dict, int]:
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
        header = json.loads(payload[_PRELUDE.size : body_offset])
        ok = isinstance(header["num_blocks"], int) and isinstance(header["formats"], list)
        ok = ok and all(isinstance(i, int) and 0 <= i < len(header["formats"]) for i in header["layers"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkPayloadError(f"unreadable chunk payload header: {exc}") from exc
    if not ok:
        raise ChunkPayloadError("malformed chunk payload header")
    return header, body_offset


def check_fits(layers: list[LayerKV], block_ids: list[int], payload: bytes) -> int:
    """Raise ChunkPayloadError unless `payload` imports into `block_ids` of `layers`; returns the
    offset of its body."""
    header, body_offset = _read_header(payload)
    if header["num_blocks"] != len(block_ids):
        raise ChunkPayloadError(f"payload holds {header['num_blocks']} blocks, target has {len(block_ids)}")
    if len(header["layers"]) != len(layers):
        raise ChunkPayloadError(
            f"payload holds {len(header['layers'])} layers, target model has {len(layers)}"
        )
    for idx, (layer, fmt_idx) in enumerate(zip(layers, header["layers"], strict=True)):
        want, got = _format_of(layer), header["formats"][fmt_idx]
        if got != want:
            raise ChunkPayloadError(f"layer {idx}: payload stores {got}, target stores {want}")
    body_len = sum(sum(_field_bytes(layer.block_fields(), len(block_ids))) for layer in layers)
    if len(payload) - body_offset != body_len:
        raise ChunkPayloadError(
            f"payload body has {len(payload) - body_offset} bytes, its layout needs {body_len}"
        )
    return body_offset


def import_chunk(layers: list[LayerKV], block_ids: list[int], payload: bytes) -> None:
    """Write an `export_chunk` payload into the already allocated blocks `block_ids` of `layers`
    (the same model and storage, in the same layer order). Checks the whole payload first
    (check_fits): on ChunkPayloadError nothing was written."""
    offset = check_fits(layers, block_ids, payload)
    for layer in layers:
        fields = layer.block_fields()
        tensors: dict[str, torch.Tensor] = {}
        for (name, (shape, dtype)), size in zip(
            fields.items(), _field_bytes(fields, len(block_ids)), strict=True
        ):
            raw = _bytes_tensor(payload, offset, size).clone()  # owns aligned memory: viewable as dtype
            tensors[name] = raw.view(dtype).reshape(len(block_ids), *shape)
            offset += size
        layer.import_blocks(block_ids, tensors)


def _bytes_tensor(payload: bytes, offset: int, size: int) -> torch.Tensor:
    """payload[offset : offset + size] as a uint8 tensor sharing its memory: read only, though torch
    cannot mark it so (hence its warning, silenced here): callers copy it before anything else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)

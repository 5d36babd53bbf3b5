"""The one entry format of the KV tiers (the disk tier; the Redis tier stores the same bytes).

An entry is a fixed header, the payload (a chunk's KV, already serialized by the caller), and a
checksum over both. Layout, little-endian (`HEADER_BYTES` = 162, `CHECKSUM_BYTES` = 16):

    [0, 8)        magic b"KVSTIER\\0"
    [8, 10)       format version, u16 (FORMAT_VERSION)
    [10, 42)      model fingerprint, ASCII, NUL-padded
    [42, 58)      codec name, ASCII, NUL-padded
    [58, 90)      sha256(namespace)
    [90, 122)     chunk (prefix) hash, 32 bytes
    [122, 154)    token-ids hash, 32 bytes (token_ids_hash)
    [154, 162)    payload length in bytes, u64
    [162, 162 + n)            payload
    [162 + n, 162 + n + 16)   xxh3_128(header || payload)

The checksum is xxHash's XXH3-128 (the `xxhash` package): it guards against accidental damage
(flipped bits, torn or truncated files), for which a non-cryptographic 128-bit hash is as good as
sha256, and it runs at ~44 GB/s where hashlib's sha256 runs at ~1.7 GB/s and blake2b at ~0.7 GB/s
(measured on the 2-core dev machine over 6 MB, one chunk of smollm2-135m fp32 KV): a restart's
warm-up reads every chunk of a prefix through it. It is no defence against someone who can write
the directory; nothing in a cache directory is.

`decode_entry` returns the payload only when every check passes; otherwise it raises
`CorruptEntry` with one `CorruptReason`. It never returns a payload stored under another key.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import numpy as np
import xxhash

MAGIC = b"KVSTIER\0"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 32
CODEC_BYTES = 16
HASH_BYTES = 32  # chunk hashes (sha256, kvcache/hashing.py), namespace and token-ids hashes
CHECKSUM_BYTES = 16

_HEADER = struct.Struct(f"<8sH{FINGERPRINT_BYTES}s{CODEC_BYTES}s{HASH_BYTES}s{HASH_BYTES}s{HASH_BYTES}sQ")
HEADER_BYTES = _HEADER.size


class CorruptReason(str, Enum):
    """Why an entry was rejected. The first five say the bytes are damaged; the last five that the
    entry is intact but was written for another key (another model, codec, namespace, chunk or
    token ids: a stale or foreign file under this name)."""

    TRUNCATED = "truncated"
    LENGTH = "length_mismatch"
    BAD_MAGIC = "bad_magic"
    VERSION = "format_version"
    CHECKSUM = "checksum"
    MODEL = "other_model"
    CODEC = "other_codec"
    NAMESPACE = "other_namespace"
    CHUNK = "other_chunk"
    TOKEN_IDS = "other_token_ids"


class CorruptEntry(Exception):
    """An entry that must not be used: the caller drops it and recomputes the chunk."""

    def __init__(self, reason: CorruptReason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason


def _fixed_ascii(value: str, size: int, field: str) -> bytes:
    raw = value.encode("ascii", errors="replace")
    if not value.isascii() or not raw or len(raw) > size or b"\0" in raw:
        raise ValueError(f"{field} must be 1 to {size} ASCII characters without NUL (got {value!r})")
    return raw.ljust(size, b"\0")


@dataclass(frozen=True)
class TierKey:
    """Everything that makes a chunk's stored KV reusable.

    `namespace` is the engine's `RuntimeInfo.namespace` (it already folds in the model fingerprint,
    tokenizer, dtype, codec, chunk and block size); the cache salt is folded into `chunk_hash`'s
    root (kvcache/hashing.py). The fingerprint and codec are kept as fields of their own so that a
    file from another model or codec is rejected with that reason.
    """

    model_fingerprint: str
    codec: str
    namespace: str
    chunk_hash: bytes

    def __post_init__(self) -> None:
        _fixed_ascii(self.model_fingerprint, FINGERPRINT_BYTES, "model_fingerprint")
        _fixed_ascii(self.codec, CODEC_BYTES, "codec")
        if len(self.chunk_hash) != HASH_BYTES:
            raise ValueError(f"chunk_hash must be {HASH_BYTES} bytes (got {len(self.chunk_hash)})")

    @cached_property
    def namespace_hash(self) -> bytes:
        return hashlib.sha256(self.namespace.encode()).digest()

    @cached_property
    def name(self) -> str:
        """Stable 64-hex-digit name of this key: the file name on disk, the key in Redis. Equal keys
        give equal names in every process and on every host; any differing field changes it."""
        h = hashlib.sha256(b"kvserve-tier-key\0")
        for part in (
            self.model_fingerprint.encode(),
            self.codec.encode(),
            self.namespace_hash,
            self.chunk_hash,
        ):
            h.update(len(part).to_bytes(4, "little") + part)
        return h.hexdigest()


def token_ids_hash(token_ids: Sequence[int]) -> bytes:
    """sha256 of a chunk's token ids as little-endian int32 (the same on every host)."""
    ids = array("i", token_ids)
    if ids.itemsize != 4:  # pragma: no cover - C int is 32-bit on every platform kvserve runs on
        raise RuntimeError("token_ids_hash needs a 4-byte C int")
    if struct.pack("=i", 1) != struct.pack("<i", 1):  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).digest()


PAYLOAD_ALIGN = 16


def entry_buffer(size: int) -> memoryview:
    """A writable buffer of `size` bytes to read an entry into, placed so that the entry's payload
    (after its HEADER_BYTES header) starts PAYLOAD_ALIGN-byte aligned: chunk_payload.parse_chunk
    then imports the payload's fields without a copy."""
    buf = np.empty(size + PAYLOAD_ALIGN, dtype=np.uint8)
    lead = -(buf.ctypes.data + HEADER_BYTES) % PAYLOAD_ALIGN
    return buf.data[lead : lead + size]


def entry_bytes(payload_bytes: int) -> int:
    """Size of an encoded entry holding `payload_bytes` of payload."""
    return HEADER_BYTES + payload_bytes + CHECKSUM_BYTES


def encode_entry_parts(key: TierKey, token_ids_hash: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """(header, checksum): the entry is header + payload + checksum. Lets a writer stream a large
    payload without joining it into one buffer."""
    if len(token_ids_hash) != HASH_BYTES:
        raise ValueError(f"token_ids_hash must be {HASH_BYTES} bytes (got {len(token_ids_hash)})")
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        _fixed_ascii(key.model_fingerprint, FINGERPRINT_BYTES, "model_fingerprint"),
        _fixed_ascii(key.codec, CODEC_BYTES, "codec"),
        key.namespace_hash,
        key.chunk_hash,
        token_ids_hash,
        len(payload),
    )
    checksum = xxhash.xxh3_128(header)
    checksum.update(payload)
    return header, checksum.digest()


def encode_entry(key: TierKey, token_ids_hash: bytes, payload: bytes) -> bytes:
    header, checksum = encode_entry_parts(key, token_ids_hash, payload)
    return b"".join((header, payload, checksum))


def decode_entry(key: TierKey, data: bytes, token_ids_hash: bytes) -> bytes:
    """`decode_entry_view`, copied into bytes of its own."""
    return bytes(decode_entry_view(key, data, token_ids_hash))


def decode_entry_view(
    key: TierKey, data: bytes | bytearray | memoryview, token_ids_hash: bytes
) -> memoryview:
    """The payload of `data` if it is an intact entry for exactly (`key`, `token_ids_hash`): a view
    into `data`, no copy.

    Checks, in order: length of the header, magic, format version, total length against the
    header's payload length, checksum, then the identity fields. Damage is therefore reported as
    damage (a flipped bit in the model field is a checksum failure), and an identity mismatch
    means an intact entry written for another key. Raises CorruptEntry; never returns a payload
    that fails a check.
    """
    if len(data) < HEADER_BYTES:
        raise CorruptEntry(CorruptReason.TRUNCATED, f"{len(data)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, fingerprint, codec, ns_hash, chunk, ids_hash, payload_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry(CorruptReason.BAD_MAGIC)
    if version != FORMAT_VERSION:
        raise CorruptEntry(CorruptReason.VERSION, f"format {version}, this kvserve reads {FORMAT_VERSION}")
    expected_len = entry_bytes(payload_len)
    if len(data) < expected_len:
        raise CorruptEntry(CorruptReason.TRUNCATED, f"{len(data)} of {expected_len} bytes")
    if len(data) > expected_len:
        raise CorruptEntry(CorruptReason.LENGTH, f"{len(data)} bytes, header says {expected_len}")
    view = memoryview(data)
    end = HEADER_BYTES + payload_len
    if xxhash.xxh3_128_digest(view[:end]) != view[end:]:
        raise CorruptEntry(CorruptReason.CHECKSUM)
    if fingerprint != _fixed_ascii(key.model_fingerprint, FINGERPRINT_BYTES, "model_fingerprint"):
        raise CorruptEntry(CorruptReason.MODEL, fingerprint.rstrip(b"\0").decode("ascii", "replace"))
    if codec != _fixed_ascii(key.codec, CODEC_BYTES, "codec"):
        raise CorruptEntry(CorruptReason.CODEC, codec.rstrip(b"\0").decode("ascii", "replace"))
    if ns_hash != key.namespace_hash:
        raise CorruptEntry(CorruptReason.NAMESPACE)
    if chunk != key.chunk_hash:
        raise CorruptEntry(CorruptReason.CHUNK)
    if ids_hash != token_ids_hash:
        raise CorruptEntry(CorruptReason.TOKEN_IDS)
    return view[HEADER_BYTES:end]

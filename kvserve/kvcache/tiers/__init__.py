"""KV tiers below the in-process pool: one entry format (entry.py) and the stores that keep it.

Built: the entry format and the disk tier (disk.py). Not wired into the engine yet; see docs/tiers.md.
"""

from kvserve.kvcache.tiers.disk import DiskTier, DiskTierStats
from kvserve.kvcache.tiers.entry import (
    CorruptEntry,
    CorruptReason,
    TierKey,
    decode_entry,
    encode_entry,
    token_ids_hash,
)

__all__ = [
    "CorruptEntry",
    "CorruptReason",
    "DiskTier",
    "DiskTierStats",
    "TierKey",
    "decode_entry",
    "encode_entry",
    "token_ids_hash",
]

"""KV tiers below the in-process pool: one entry format (entry.py), the stores that keep it (disk.py,
redis_tier.py), the lossy cold area (cold.py) and KVTiers (manager.py), which the engine drives
(tiers/engine_side.py). See docs/tiers.md.
"""

from kvserve.tiers.disk import DiskTier, DiskTierStats
from kvserve.tiers.entry import (
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

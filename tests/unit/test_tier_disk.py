"""The tiers' entry format and the disk tier: round trips, every rejection reason, LRU bound,
restart, leftover temp files, threads, two instances on one directory, and kill -9 during writes."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.errors import ConfigError
from kvserve.tiers import (
    CorruptEntry,
    CorruptReason,
    DiskTier,
    TierKey,
    decode_entry,
    encode_entry,
    token_ids_hash,
)
from kvserve.tiers.entry import CHECKSUM_BYTES, HEADER_BYTES, entry_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]

# Shared by this module and the chaos writer subprocess: the expected payload is a deterministic
# function of the key, so any file can be checked against what was written for its name.
KEYS_SOURCE = """
import hashlib
from kvserve.tiers.entry import TierKey, token_ids_hash

def chaos_key(i):
    return TierKey("fp-chaos", "turbo3", "ns|chaos", hashlib.sha256(b"chunk%d" % i).digest())

def chaos_ids_hash(i):
    return token_ids_hash(range(i, i + 128))

def chaos_payload(i):
    size = 20_000 + (i * 7919) % 400_000
    block = hashlib.sha256(b"payload%d" % i).digest()
    return (block * (size // len(block) + 1))[:size]
"""
_helpers: dict = {}
exec(KEYS_SOURCE, _helpers)
chaos_key, chaos_ids_hash, chaos_payload = (
    _helpers["chaos_key"],
    _helpers["chaos_ids_hash"],
    _helpers["chaos_payload"],
)

# The writer imports only the tiers package: a stub `kvserve` package skips kvserve/__init__ (torch).
WRITER_SOURCE = f"""
import os, random, sys, types
pkg = types.ModuleType("kvserve")
pkg.__path__ = [os.path.join(sys.argv[1], "kvserve")]
sys.modules["kvserve"] = pkg
from kvserve.tiers.disk import DiskTier
{KEYS_SOURCE}
tier = DiskTier(sys.argv[2], max_bytes=int(sys.argv[3]))
rng = random.Random(int(sys.argv[4]))
print("ready", flush=True)
while True:
    i = rng.randrange(48)
    tier.put(chaos_key(i), chaos_ids_hash(i), chaos_payload(i))
"""


def make_key(i: int = 0, **changes: object) -> TierKey:
    key = TierKey("fp-model-a", "bfloat16", "fp-model-a|bf16|chunk=128", hashlib.sha256(b"c%d" % i).digest())
    return dataclasses.replace(key, **changes) if changes else key


def ids_hash(i: int = 0) -> bytes:
    return token_ids_hash(list(range(i, i + 128)))


def payload_of(i: int, size: int = 1000) -> bytes:
    return (hashlib.sha256(b"p%d" % i).digest() * (size // 32 + 1))[:size]


# ----------------------------------------------------------------------------- entry format
def test_entry_round_trip_and_size():
    for size in (0, 1, 4096, 300_001):
        data = encode_entry(make_key(), ids_hash(), payload_of(1, size))
        assert len(data) == entry_bytes(size) == HEADER_BYTES + size + CHECKSUM_BYTES
        assert decode_entry(make_key(), data, ids_hash()) == payload_of(1, size)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("model_fingerprint", "fp-model-b", CorruptReason.MODEL),
        ("codec", "turbo3", CorruptReason.CODEC),
        ("namespace", "fp-model-a|bf16|chunk=64", CorruptReason.NAMESPACE),
        ("chunk_hash", hashlib.sha256(b"other").digest(), CorruptReason.CHUNK),
    ],
)
def test_every_key_field_changes_the_name_and_is_checked(field, value, reason):
    other = make_key(**{field: value})
    assert other.name != make_key().name
    data = encode_entry(make_key(), ids_hash(), payload_of(0))
    with pytest.raises(CorruptEntry) as err:
        decode_entry(other, data, ids_hash())
    assert err.value.reason is reason


def test_other_token_ids_are_rejected_and_names_are_stable():
    data = encode_entry(make_key(), ids_hash(0), payload_of(0))
    with pytest.raises(CorruptEntry) as err:
        decode_entry(make_key(), data, ids_hash(1))
    assert err.value.reason is CorruptReason.TOKEN_IDS
    assert make_key().name == make_key().name and len(make_key().name) == 64
    assert token_ids_hash([1, 2, 3]) == token_ids_hash((1, 2, 3)) != token_ids_hash([1, 2, 4])


def test_key_validation_says_what_is_wrong():
    with pytest.raises(ValueError, match="chunk_hash must be 32 bytes"):
        make_key(chunk_hash=b"short")
    with pytest.raises(ValueError, match="codec must be 1 to 16 ASCII"):
        make_key(codec="x" * 17)
    with pytest.raises(ValueError, match="model_fingerprint"):
        make_key(model_fingerprint="")


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _flip(d, 0), CorruptReason.BAD_MAGIC),
        (lambda d: _flip(d, 8), CorruptReason.VERSION),
        (lambda d: _flip(d, 12), CorruptReason.CHECKSUM),  # model fingerprint byte
        (lambda d: _flip(d, 100), CorruptReason.CHECKSUM),  # chunk hash byte
        (lambda d: _flip(d, HEADER_BYTES + 500), CorruptReason.CHECKSUM),  # payload byte
        (lambda d: _flip(d, len(d) - 1), CorruptReason.CHECKSUM),  # checksum byte
        (lambda d: d[:-1], CorruptReason.TRUNCATED),
        (lambda d: d[: HEADER_BYTES + 10], CorruptReason.TRUNCATED),
        (lambda d: d[:50], CorruptReason.TRUNCATED),
        (lambda d: b"", CorruptReason.TRUNCATED),
        (lambda d: d + b"\0", CorruptReason.LENGTH),
        (lambda d: _flip(d, HEADER_BYTES - 8), CorruptReason.LENGTH),  # payload length field, +16
    ],
)
def test_damage_is_detected_with_its_reason(damage, reason):
    data = encode_entry(make_key(), ids_hash(), payload_of(0, 2000))
    with pytest.raises(CorruptEntry) as err:
        decode_entry(make_key(), damage(data), ids_hash())
    assert err.value.reason is reason


def test_every_single_byte_flip_is_rejected():
    data = encode_entry(make_key(), ids_hash(), payload_of(0, 300))
    for at in range(len(data)):
        with pytest.raises(CorruptEntry):
            decode_entry(make_key(), _flip(data, at), ids_hash())


# ----------------------------------------------------------------------------- disk tier
def test_disk_round_trip_miss_and_stats(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    assert tier.get(make_key(0), ids_hash(0)) is None
    assert tier.put(make_key(0), ids_hash(0), payload_of(0))
    assert not tier.put(make_key(0), ids_hash(0), payload_of(0))  # already stored: skipped
    assert tier.get(make_key(0), ids_hash(0)) == payload_of(0)
    assert tier.get(make_key(1), ids_hash(1)) is None
    assert make_key(0) in tier and make_key(1) not in tier
    s = tier.stats()
    assert (s.num_entries, s.stored_bytes, s.hits, s.misses, s.writes, s.write_skips) == (
        1,
        entry_bytes(1000),
        1,
        2,
        1,
        1,
    )
    assert s.load_seconds_total > 0 and s.mean_load_s <= s.load_seconds_max
    assert sorted(p.name for p in tmp_path.iterdir()) == [make_key(0).name + ".kv"]
    tier.check_integrity()


def _foreign_model_file(data: bytes) -> bytes:
    return encode_entry(make_key(0, model_fingerprint="fp-model-b"), ids_hash(0), payload_of(0))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _flip(d, 20), "checksum"),  # header
        (lambda d: _flip(d, HEADER_BYTES + 7), "checksum"),  # payload
        (lambda d: d[: len(d) // 2], "truncated"),
        (_foreign_model_file, "other_model"),  # same file name, written for another model
    ],
)
def test_disk_corruption_is_counted_removed_and_recovers(tmp_path, damage, reason):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    tier.put(make_key(0), ids_hash(0), payload_of(0))
    path = tmp_path / (make_key(0).name + ".kv")
    path.write_bytes(damage(path.read_bytes()))
    assert tier.get(make_key(0), ids_hash(0)) is None
    assert not path.exists()
    s = tier.stats()
    assert s.corruptions == {reason: 1} and s.misses == 1 and s.hits == 0 and s.num_entries == 0
    tier.check_integrity()
    assert tier.put(make_key(0), ids_hash(0), payload_of(0))  # the recomputed chunk is stored again
    assert tier.get(make_key(0), ids_hash(0)) == payload_of(0)


def test_lru_bound_evicts_least_recently_used(tmp_path):
    size = entry_bytes(1000)
    tier = DiskTier(tmp_path, max_bytes=3 * size + 10)
    for i in range(3):
        tier.put(make_key(i), ids_hash(i), payload_of(i))
    assert tier.get(make_key(0), ids_hash(0)) == payload_of(0)  # 1 is now the least recently used
    tier.put(make_key(3), ids_hash(3), payload_of(3))
    assert make_key(1) not in tier and not (tmp_path / (make_key(1).name + ".kv")).exists()
    assert tier.get(make_key(1), ids_hash(1)) is None
    for i in (0, 2, 3):
        assert tier.get(make_key(i), ids_hash(i)) == payload_of(i)
    s = tier.stats()
    assert s.evictions == 1 and s.num_entries == 3 and s.stored_bytes == 3 * size <= tier.max_bytes
    tier.check_integrity()
    assert not tier.put(make_key(9), ids_hash(9), payload_of(9, 4 * size))  # can never fit
    assert tier.stats().rejected_too_large == 1


def test_touch_makes_an_entry_the_last_to_go_and_survives_a_restart(tmp_path):
    """The shutdown write touches the hot chunks already on disk so that its own writes evict others."""
    size = entry_bytes(1000)
    tier = DiskTier(tmp_path, max_bytes=3 * size)
    for i in range(3):
        tier.put(make_key(i), ids_hash(i), payload_of(i))
    old_s = time.time() - 100
    for i in range(3):
        os.utime(tmp_path / (make_key(i).name + ".kv"), (old_s + i, old_s + i))
    assert tier.touch(make_key(0)) == size and tier.touch(make_key(7)) == 0
    assert (tmp_path / (make_key(0).name + ".kv")).stat().st_mtime > old_s + 50  # the restart's order
    tier.put(make_key(3), ids_hash(3), payload_of(3))
    assert make_key(0) in tier and make_key(1) not in tier
    tier.check_integrity()
    restarted = DiskTier(tmp_path, max_bytes=2 * size)  # a smaller bound: the least recently used go
    assert make_key(0) in restarted and make_key(3) in restarted and make_key(2) not in restarted


def test_restart_finds_entries_in_last_use_order(tmp_path):
    size = entry_bytes(1000)
    first = DiskTier(tmp_path, max_bytes=3 * size)
    for i in range(3):
        first.put(make_key(i), ids_hash(i), payload_of(i))
    base_s = time.time() - 100
    for age_rank, i in enumerate((1, 2, 0)):  # last use: 1 oldest, then 2, then 0
        os.utime(tmp_path / (make_key(i).name + ".kv"), (base_s + age_rank, base_s + age_rank))
    second = DiskTier(tmp_path, max_bytes=3 * size)
    assert second.stats().num_entries == 3 and second.stats().stored_bytes == 3 * size
    second.check_integrity()
    second.put(make_key(3), ids_hash(3), payload_of(3))
    assert make_key(1) not in second
    assert [second.get(make_key(i), ids_hash(i)) for i in (0, 2, 3)] == [payload_of(i) for i in (0, 2, 3)]
    smaller = DiskTier(tmp_path, max_bytes=size)  # a restart with a smaller bound evicts down to it
    assert smaller.stats().num_entries == 1 and smaller.stats().evictions == 2
    smaller.check_integrity()


def test_leftover_temp_files_are_removed_at_start(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(done.stdout)
    dead = tmp_path / f".tmp-{dead_pid}-abc"
    garbage = tmp_path / ".tmp-notapid"
    live_fresh = tmp_path / f".tmp-{os.getpid()}-writing"
    live_stale = tmp_path / f".tmp-{os.getpid()}-old"
    unrelated = tmp_path / "notes.txt"
    for p in (dead, garbage, live_fresh, live_stale, unrelated):
        p.write_bytes(b"partial")
    os.utime(live_stale, (time.time() - 7200, time.time() - 7200))
    tier = DiskTier(tmp_path, max_bytes=1 << 20, stale_temp_s=3600)
    assert tier.stats().temp_files_removed == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_fresh.name, unrelated.name])
    assert tier.stats().num_entries == 0


def test_bad_settings_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="kv_disk_bytes must be > 0"):
        DiskTier(tmp_path, max_bytes=0)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="pass a writable directory"):
        DiskTier(tmp_path / "file" / "sub", max_bytes=100)


def test_a_directory_replaced_by_a_file_costs_each_write_its_entry_and_logs_once(tmp_path, caplog):
    """Issue 62.4: with the directory replaced by a file, put's cleanup unlink raised too
    (NotADirectoryError) and escaped put, so the tier writer lost the rest of its batch, with a
    warning and a traceback for every write."""
    directory = tmp_path / "kv"
    tier = DiskTier(directory, max_bytes=1 << 20)
    assert tier.put(make_key(0), ids_hash(0), payload_of(0))
    for p in directory.iterdir():
        p.unlink()
    directory.rmdir()
    directory.write_bytes(b"not a directory")
    with caplog.at_level(logging.DEBUG, logger="kvserve.tiers"):
        assert [tier.put(make_key(i), ids_hash(i), payload_of(i)) for i in range(1, 6)] == [False] * 5
        assert [tier.get(make_key(i), ids_hash(i)) for i in range(3)] == [None] * 3
    s = tier.stats()
    assert (s.writes, s.write_errors, s.read_errors) == (1, 5, 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings  # the first failed write and the first failed read
    assert "writing" in warnings[0] and "later failures like it are counted" in warnings[0]
    assert "reading" in warnings[1]
    assert not any(r.exc_info for r in caplog.records)
    directory.unlink()  # the directory is back: writes work again
    directory.mkdir()
    assert tier.put(make_key(6), ids_hash(6), payload_of(6))
    assert tier.get(make_key(6), ids_hash(6)) == payload_of(6)


def test_two_instances_share_a_directory(tmp_path):
    a = DiskTier(tmp_path, max_bytes=1 << 20)
    b = DiskTier(tmp_path, max_bytes=1 << 20)
    a.put(make_key(0), ids_hash(0), payload_of(0))
    assert b.get(make_key(0), ids_hash(0)) == payload_of(0)  # b learns of a's file on a hit
    assert b.stats().num_entries == 1
    small = DiskTier(tmp_path, max_bytes=entry_bytes(1000))
    small.put(make_key(1), ids_hash(1), payload_of(1))  # evicts key 0 under a and b
    assert a.get(make_key(0), ids_hash(0)) is None and make_key(0) not in a
    assert b.get(make_key(1), ids_hash(1)) == payload_of(1)


def test_a_file_evicted_while_read_is_served_but_not_indexed(tmp_path, monkeypatch):
    """Regression: a file read by `get`, then evicted before `get` took the lock, was indexed
    although gone (the index disagreed with the directory)."""
    from kvserve.tiers import disk

    writer = DiskTier(tmp_path, max_bytes=1 << 20)
    reader = DiskTier(tmp_path, max_bytes=1 << 20)
    writer.put(make_key(0), ids_hash(0), payload_of(0))
    real_decode = disk.decode_entry_view

    def decode_then_evict(key, data, token_ids_hash):
        (tmp_path / (key.name + ".kv")).unlink()  # another process's eviction, mid-get
        return real_decode(key, data, token_ids_hash)

    monkeypatch.setattr(disk, "decode_entry_view", decode_then_evict)
    assert reader.get(make_key(0), ids_hash(0)) == payload_of(0)
    assert make_key(0) not in reader
    reader.check_integrity()


def test_a_put_landing_during_a_missed_get_stays_indexed(tmp_path, monkeypatch):
    """Regression: a get that missed (no file at open) and then took the lock after a put of the
    same name had landed dropped that put's entry from the index."""
    from kvserve.tiers import disk

    tier = DiskTier(tmp_path, max_bytes=1 << 20)

    def open_missing_while_put_lands(path, mode="r"):
        tier.put(make_key(0), ids_hash(0), payload_of(0))  # another thread, between open and lock
        raise FileNotFoundError(path)

    monkeypatch.setattr(disk, "open", open_missing_while_put_lands, raising=False)
    assert tier.get(make_key(0), ids_hash(0)) is None
    monkeypatch.undo()
    assert make_key(0) in tier
    tier.check_integrity()
    assert tier.get(make_key(0), ids_hash(0)) == payload_of(0)


def test_threads_put_and_get_concurrently(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=12 * entry_bytes(3000))
    wrong: list[int] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                i = rng.randrange(24)
                if rng.random() < 0.5:
                    tier.put(make_key(i), ids_hash(i), payload_of(i, 3000))
                else:
                    got = tier.get(make_key(i), ids_hash(i))
                    if got is not None and got != payload_of(i, 3000):
                        wrong.append(i)
        except BaseException as e:  # surfaced below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    s = tier.stats()
    assert s.hits > 0 and s.evictions > 0 and not s.corruptions and s.write_errors == 0
    tier.check_integrity()


def test_kill_9_during_writes_never_leaves_an_accepted_wrong_file(tmp_path):
    """A writer process puts entries (with eviction) in a loop and is SIGKILLed at random moments
    (mid-write in most rounds: it leaves a temp file); afterwards every entry file decodes to exactly
    its key's payload, and a restarted tier serves only those."""
    rng = random.Random(15)
    max_bytes = 3_000_000
    for round_ in range(6):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER_SOURCE, str(REPO_ROOT), str(tmp_path), str(max_bytes), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=10) == -signal.SIGKILL
    names = {chaos_key(i).name + ".kv": i for i in range(48)}
    entry_files = [p for p in tmp_path.iterdir() if p.name in names]
    assert entry_files, "the writer stored nothing: the test checked nothing"
    accepted, torn = 0, []
    for path in entry_files:
        i = names[path.name]
        try:
            payload = decode_entry(chaos_key(i), path.read_bytes(), chaos_ids_hash(i))
        except CorruptEntry as e:
            torn.append(f"{path.name}: {e}")
            continue
        assert payload == chaos_payload(i), f"{path.name} decoded to a wrong payload"
        accepted += 1
    # Rejection would have kept the answers right, but with temp file + rename a killed process
    # (whose page cache survives) never leaves a partial file under an entry name at all.
    assert not torn, f"partial files visible under entry names: writes are not atomic: {torn}"
    tier = DiskTier(tmp_path, max_bytes=max_bytes)  # the restart removes the killed writers' temp files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    for i in range(48):
        got = tier.get(chaos_key(i), chaos_ids_hash(i))
        assert got is None or got == chaos_payload(i)
    assert tier.stats().hits == accepted > 0
    tier.check_integrity()

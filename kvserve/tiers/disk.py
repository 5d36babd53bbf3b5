"""DiskTier: chunks' KV entries (entry.py format) as files in one directory, bounded by bytes, LRU.

Files: `<key.name>.kv` (64 hex digits) for entries, `.tmp-<pid>-<random>` while one is written.

Rules:
- A file under an entry's name is only ever produced by rename of a complete, fsynced temp file,
  so a reader sees a whole entry or none; a crash (kill -9, power loss after the rename's directory
  fsync) leaves at most a temp file, removed at the next start if its writer is gone.
- `get` returns a payload only through `decode_entry`: a damaged or foreign file is counted by
  reason, removed, and reported as a miss; never a wrong payload.
- The directory holds at most `max_bytes` of entries this instance knows of (file sizes, headers
  included): `put` evicts least recently used entries before it renames. Last use is kept in
  memory and in the file's mtime (set on every hit), which orders the index after a restart.
- Thread-safe: the index and counters sit behind one lock; file reads, writes and fsyncs run
  outside it (renames and eviction unlinks inside, so the index matches the directory).
- Several processes may share the directory (docs/tiers.md, "Sharing"): a file unlinked or
  replaced under a reader leaves the reader its open inode or a miss, never a wrong answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from io import BufferedReader
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.tiers.entry import (
    CorruptEntry,
    TierKey,
    decode_entry_view,
    encode_entry_parts,
    entry_buffer,
    entry_bytes,
)

log = logging.getLogger("kvserve.tiers")

ENTRY_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
_NAME_CHARS = frozenset("0123456789abcdef")


@dataclass
class DiskTierStats:
    """A snapshot of a DiskTier's counters. `misses` counts every `get` that returned None,
    corrupt and unreadable entries included; `corruptions` says why entries were rejected."""

    num_entries: int
    stored_bytes: int
    max_bytes: int
    hits: int
    misses: int
    writes: int
    write_skips: int  # put of a name already indexed: nothing written
    write_errors: int  # OSError while writing (disk full, permissions): nothing stored
    rejected_too_large: int  # one entry larger than max_bytes
    read_errors: int  # OSError other than "no such file" while reading
    evictions: int
    temp_files_removed: int
    corruptions: dict[str, int] = field(default_factory=dict)
    load_seconds_total: float = 0.0  # over hits: read + decode
    load_seconds_max: float = 0.0

    @property
    def mean_load_s(self) -> float:
        return self.load_seconds_total / self.hits if self.hits else 0.0


def _is_entry_file(file_name: str) -> bool:
    stem = file_name[: -len(ENTRY_SUFFIX)]
    return file_name.endswith(ENTRY_SUFFIX) and len(stem) == 64 and set(stem) <= _NAME_CHARS


def _read_aligned(f: BufferedReader) -> memoryview:
    """The whole file, in an `entry_buffer` (its payload aligned)."""
    view = entry_buffer(os.fstat(f.fileno()).st_size)
    return view[: f.readinto(view)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """Entries on local disk, at most `max_bytes` of them, least recently used evicted first.

    `stale_temp_s`: at start, a temp file is removed when its writer process is gone, or when it
    is older than this whatever its pid says (a pid reused after a crash).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, stale_temp_s: float = 3600.0):
        if max_bytes <= 0:
            raise ConfigError(f"kv_disk_bytes must be > 0 (got {max_bytes})", param="kv_disk_bytes")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.stale_temp_s = stale_temp_s
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"kv_disk_dir {str(self.directory)!r} cannot be created ({e}); pass a writable directory",
                param="kv_disk_dir",
            ) from e
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ConfigError(
                f"kv_disk_dir {str(self.directory)!r} is not writable; pass a writable directory",
                param="kv_disk_dir",
            )
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # name -> file bytes, least recently used first
        self._stored_bytes = 0
        self._counts: Counter[str] = Counter()
        self._corruptions: Counter[str] = Counter()
        self._load_seconds_total = 0.0
        self._load_seconds_max = 0.0
        self._logged_faults: set[tuple[str, str, int | None]] = set()  # (operation, type, errno)
        self._scan()

    # ----------------------------------------------------------------------------- public
    def put(self, key: TierKey, token_ids_hash: bytes, payload: bytes) -> bool:
        """Store `payload` under `key` unless an entry of that name is already indexed. Returns
        whether a file was written. I/O errors are counted (`write_errors`) and logged the first time
        of each kind (_log_fault), never raised: a tier that cannot write costs that entry alone,
        recomputed later."""
        name = key.name
        size = entry_bytes(len(payload))
        with self._lock:
            if size > self.max_bytes:
                self._counts["rejected_too_large"] += 1
                return False
            if name in self._lru:
                self._lru.move_to_end(name)
                self._counts["write_skips"] += 1
                return False
        header, checksum = encode_entry_parts(key, token_ids_hash, payload)
        temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.write(checksum)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                self._make_room(size)
                os.replace(temp, self._path(name))
                self._forget(name)  # a concurrent put of the same name: its bytes were replaced
                self._remember(name, size)
                self._counts["writes"] += 1
            self._fsync_directory()
        except OSError as e:
            self._log_fault("writing", name, e, "the chunk stays uncached on disk")
            with self._lock:
                self._counts["write_errors"] += 1
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory is gone or replaced (ENOTDIR): a temp file left is removed at the next start
            return False
        return True

    def get(self, key: TierKey, token_ids_hash: bytes) -> memoryview | None:
        """The payload stored for (`key`, `token_ids_hash`), or None. A file that fails any check of
        `decode_entry` is counted under its reason, removed, and None is returned. The payload is a
        view into the buffer the file was read into, 16-byte aligned (chunk_payload.parse_chunk
        then imports its fields without a copy)."""
        name = key.name
        path = self._path(name)
        start_s = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = _read_aligned(f)
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            with self._lock:
                if not path.exists():  # evicted by another process, or never stored (a put renames
                    self._forget(name)  # under this lock: it may have landed since the open)
                self._counts["misses"] += 1
            return None
        except OSError as e:
            self._log_fault("reading", name, e, "recomputing the chunk")
            with self._lock:
                self._counts["read_errors"] += 1
                self._counts["misses"] += 1
            return None
        try:
            payload = decode_entry_view(key, data, token_ids_hash)
        except CorruptEntry as e:
            self._drop_corrupt(path, inode, name, e)
            return None
        load_s = time.perf_counter() - start_s
        try:
            os.utime(path)  # last use survives a restart
        except OSError:
            pass  # removed meanwhile: this answer is still right
        with self._lock:
            self._counts["hits"] += 1
            self._load_seconds_total += load_s
            self._load_seconds_max = max(self._load_seconds_max, load_s)
            if name in self._lru:
                self._lru.move_to_end(name)
            elif self._same_file(path, inode):  # written by another process sharing the directory
                self._remember(name, len(data))
                self._make_room(0)
            # else: evicted (by this or another process) since it was read; the answer stays right
        return payload

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = self._counts
            return DiskTierStats(
                num_entries=len(self._lru),
                stored_bytes=self._stored_bytes,
                max_bytes=self.max_bytes,
                hits=c["hits"],
                misses=c["misses"],
                writes=c["writes"],
                write_skips=c["write_skips"],
                write_errors=c["write_errors"],
                rejected_too_large=c["rejected_too_large"],
                read_errors=c["read_errors"],
                evictions=c["evictions"],
                temp_files_removed=c["temp_files_removed"],
                corruptions=dict(self._corruptions),
                load_seconds_total=self._load_seconds_total,
                load_seconds_max=self._load_seconds_max,
            )

    def __contains__(self, key: TierKey) -> bool:
        """Whether this instance's index holds `key` (no disk access; `get` may still miss)."""
        with self._lock:
            return key.name in self._lru

    def touch(self, key: TierKey) -> int:
        """Mark `key`'s entry as just used (the index's order and the file's mtime, which orders the
        index after a restart): the last entries `put` would evict. Its size in bytes; 0 when this
        instance does not index it."""
        with self._lock:
            size = self._lru.get(key.name, 0)
            if size:
                self._lru.move_to_end(key.name)
        if size:
            try:
                os.utime(self._path(key.name))
            except OSError:
                pass  # removed meanwhile (another process): a later get misses, never a wrong answer
        return size

    def may_hold(self, key: TierKey) -> bool:
        """Whether `get` could find `key`: it is indexed, or a file of its name exists (another
        process sharing the directory wrote it). One stat at most; `get` may still miss."""
        return key in self or self._path(key.name).exists()

    def check_integrity(self) -> None:
        """Index == directory for a directory this instance alone writes: every indexed file
        exists with its indexed size, sizes sum to stored bytes, the bound holds."""
        with self._lock:
            assert self._stored_bytes == sum(self._lru.values()), "stored bytes drifted from the index"
            assert self._stored_bytes <= self.max_bytes, "the byte bound was exceeded"
            on_disk = {p.name[: -len(ENTRY_SUFFIX)]: p.stat().st_size for p in self._entry_files()}
            assert on_disk == dict(self._lru), "index and directory disagree"

    # ---------------------------------------------------------------------------- private
    def _path(self, name: str) -> Path:
        return self.directory / f"{name}{ENTRY_SUFFIX}"

    def _entry_files(self) -> list[Path]:
        return [p for p in self.directory.iterdir() if _is_entry_file(p.name)]

    def _scan(self) -> None:
        """Rebuild the index from the directory, oldest mtime first; remove dead writers' temp
        files; evict down to max_bytes (a restart with a smaller bound)."""
        found: list[tuple[float, str, int]] = []
        now_s = time.time()
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
                if self._temp_is_abandoned(entry.name, st.st_mtime, now_s):
                    Path(entry.path).unlink(missing_ok=True)
                    self._counts["temp_files_removed"] += 1
            elif _is_entry_file(entry.name) and entry.is_file(follow_symlinks=False):
                found.append((st.st_mtime, entry.name[: -len(ENTRY_SUFFIX)], st.st_size))
        with self._lock:
            for _, name, size in sorted(found):
                self._remember(name, size)
            self._make_room(0)

    def _temp_is_abandoned(self, file_name: str, mtime_s: float, now_s: float) -> bool:
        pid_text = file_name[len(TEMP_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            return True
        return not _pid_alive(int(pid_text)) or now_s - mtime_s > self.stale_temp_s

    def _remember(self, name: str, size: int) -> None:
        self._lru[name] = size
        self._stored_bytes += size

    def _forget(self, name: str) -> None:
        size = self._lru.pop(name, None)
        if size is not None:
            self._stored_bytes -= size

    def _make_room(self, incoming_bytes: int) -> None:
        """Evict least recently used entries until `incoming_bytes` more fit (lock held)."""
        while self._lru and self._stored_bytes + incoming_bytes > self.max_bytes:
            name, size = self._lru.popitem(last=False)
            self._stored_bytes -= size
            self._path(name).unlink(missing_ok=True)  # another process may have removed it
            self._counts["evictions"] += 1

    @staticmethod
    def _same_file(path: Path, inode: int) -> bool:
        """Whether `path` is still the file that was read (not unlinked, not replaced)."""
        try:
            return os.stat(path).st_ino == inode
        except FileNotFoundError:
            return False

    def _drop_corrupt(self, path: Path, inode: int, name: str, error: CorruptEntry) -> None:
        log.warning("disk tier: %s rejected (%s); removed, the chunk is recomputed", path.name, error)
        with self._lock:  # a put of this name in this process renames under the same lock
            if self._same_file(path, inode):
                path.unlink(missing_ok=True)
                self._forget(name)
            elif not path.exists():
                self._forget(name)
            # else: a good entry was renamed over the damaged one since it was read: keep it
            self._corruptions[error.reason.value] += 1
            self._counts["misses"] += 1

    def _log_fault(self, operation: str, name: str, error: OSError, outcome: str) -> None:
        """A warning for the first fault of its kind (operation, exception type, errno), debug for
        the rest: a disk that fails every write logs once, not once per chunk; the counters in
        `stats` (and /metrics) count every one."""
        kind = (operation, type(error).__name__, error.errno)
        with self._lock:
            first = kind not in self._logged_faults
            self._logged_faults.add(kind)
        level = logging.WARNING if first else logging.DEBUG
        later = "; later failures like it are counted, not logged" if first else ""
        log.log(level, "disk tier: %s %s failed (%s); %s%s", operation, name, error, outcome, later)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["DiskTier", "DiskTierStats"]

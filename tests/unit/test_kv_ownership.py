"""The KVCacheManager (kvserve/kvcache/manager.py, with entries.py: the CacheEntries it calls with a
request's Holding) is the only owner that takes pool refs: every call of a block pool's `allocate` or
`retain` in the package is in those two modules; and nothing outside kvcache/
calls a method of the pool or the chunk store that changes them (pins and idle eviction go through
the manager's verbs). Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvserve"
OWNER = ROOT / "kvcache" / "manager.py"
OWNERS = {OWNER, ROOT / "kvcache" / "entries.py"}


KVCACHE = ROOT / "kvcache"
# what changes a pool or a chunk store (kvcache/block_pool.py, kvcache/chunk_store.py), and the
# registration of an eviction hook (a list the store calls)
POOL_MUTATORS = ("allocate", "retain", "release", "reset")
STORE_MUTATORS = (
    "acquire",
    "release",
    "insert",
    "pin",
    "unpin",
    "reserve_pins",
    "release_pin_reservation",
    "evict",
    "evict_idle",
    "drop_windows",
    "restore_window",
    "reset",
)


def calls_on(
    path: Path, receiver_suffix: str, methods: tuple[str, ...], root: Path = ROOT.parent
) -> list[str]:
    """`<...>.method(...)` calls (and `<...>.on_evict.append(...)` for a store) whose receiver's last
    name ends in `receiver_suffix`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        name, attr = receiver.split(".")[-1], node.func.attr
        hooked = receiver_suffix == "store" and name == "on_evict" and attr == "append"
        if (attr in methods and name.endswith(receiver_suffix)) or hooked:
            found.append(f"{path.relative_to(root)}:{node.lineno} {receiver}.{attr}")
    return found


def pool_ref_calls(path: Path, root: Path = ROOT.parent) -> list[str]:
    """`<...>.allocate(...)` and `<...>.retain(...)` calls whose receiver's name ends in "pool"."""
    return calls_on(path, "pool", ("allocate", "retain"), root)


def test_only_the_kv_manager_takes_pool_refs():
    calls = {p: pool_ref_calls(p) for p in sorted(ROOT.rglob("*.py"))}
    assert calls[OWNER], "the check finds nothing: the manager's own calls should be seen"
    assert calls[ROOT / "kvcache" / "entries.py"], "nor the entries' (commits, imports)"
    others = [c for p, found in calls.items() if p not in OWNERS for c in found]
    assert others == [], f"pool refs taken outside the KVCacheManager: {others}"


def test_the_check_sees_a_call_elsewhere(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text(
        "def f(self, pool, other):\n    self.kv.pool.allocate(2)\n    pool.retain([1])\n    other.retain([1])\n"
    )
    assert pool_ref_calls(stray, tmp_path) == ["stray.py:2 self.kv.pool.allocate", "stray.py:3 pool.retain"]


def test_nothing_outside_the_kv_cache_changes_the_pool_or_the_chunk_store():
    outside = [p for p in sorted(ROOT.rglob("*.py")) if KVCACHE not in p.parents]
    calls = [
        c for p in outside for c in calls_on(p, "pool", POOL_MUTATORS) + calls_on(p, "store", STORE_MUTATORS)
    ]
    assert calls == [], f"the pool or the chunk store changed outside kvcache/: {calls}"
    inside = calls_on(KVCACHE / "manager.py", "store", STORE_MUTATORS)
    assert inside, "the check finds nothing: the manager's own calls should be seen"


def test_the_store_check_sees_a_pin_and_a_hook_elsewhere(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text("def f(self):\n    self.store.pin(b'o', [])\n    self.kv.store.on_evict.append(print)\n")
    assert calls_on(stray, "store", STORE_MUTATORS, tmp_path) == [
        "stray.py:2 self.store.pin",
        "stray.py:3 self.kv.store.on_evict.append",
    ]


def test_the_managers_docstring_names_this_check():
    """Issue 62.6: the manager's docstring sent readers to tests/unit/test_import_layers.py, which
    checks import order, not pool refs."""
    text = " ".join(OWNER.read_text().split())
    assert "`allocate` and `retain` (tests/unit/test_kv_ownership.py checks that)" in text
    assert "test_import_layers.py" not in text

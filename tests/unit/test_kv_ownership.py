"""The KVCacheManager (kvserve/kvcache/manager.py) is the only module that takes pool refs: every
call of a block pool's `allocate` or `retain` in the package is in it. Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvserve"
OWNER = ROOT / "kvcache" / "manager.py"


def pool_ref_calls(path: Path, root: Path = ROOT.parent) -> list[str]:
    """`<...>.allocate(...)` and `<...>.retain(...)` calls whose receiver's name ends in "pool"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("allocate", "retain"):
            continue
        receiver = ast.unparse(node.func.value)
        if receiver.split(".")[-1].endswith("pool"):
            found.append(f"{path.relative_to(root)}:{node.lineno} {receiver}.{node.func.attr}")
    return found


def test_only_the_kv_manager_takes_pool_refs():
    calls = {p: pool_ref_calls(p) for p in sorted(ROOT.rglob("*.py"))}
    assert calls[OWNER], "the check finds nothing: the manager's own calls should be seen"
    others = [c for p, found in calls.items() if p != OWNER for c in found]
    assert others == [], f"pool refs taken outside the KVCacheManager: {others}"


def test_the_check_sees_a_call_elsewhere(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text(
        "def f(self, pool, other):\n    self.kv.pool.allocate(2)\n    pool.retain([1])\n    other.retain([1])\n"
    )
    assert pool_ref_calls(stray, tmp_path) == ["stray.py:2 self.kv.pool.allocate", "stray.py:3 pool.retain"]


def test_the_managers_docstring_names_this_check():
    """Issue 62.6: the manager's docstring sent readers to tests/unit/test_import_layers.py, which
    checks import order, not pool refs."""
    text = " ".join(OWNER.read_text().split())
    assert "`allocate` and `retain` (tests/unit/test_kv_ownership.py checks that)" in text
    assert "test_import_layers.py" not in text

"""The layer rule (docs/architecture.md): a kvserve package imports only packages below it, and no
module imports its way back to itself. Read from the source (every import statement, a function's
lazy ones too). The layer rule leaves `if TYPE_CHECKING:` blocks aside (they never run); the cycle
rule counts them: a module that names another's type for the checker still depends on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvserve"

# Top to bottom; a unit on a line imports only units on lower lines (and its own modules). A unit is
# a package under kvserve/ or a module directly in it; "kvserve" is the package's own __init__.
LAYERS = [
    ["cli"],
    ["cluster"],
    ["serving"],
    ["api"],
    ["kvserve"],
    ["llm", "metrics"],
    ["stat_table"],
    ["engine"],
    ["tiers"],
    ["scheduler", "structured"],
    ["reuse"],
    ["models"],
    ["attention"],
    ["kernels"],
    ["kvcache"],
    ["quant"],
    ["config", "request", "tokenizer"],
    ["config_types", "config_slices"],
    ["errors", "redact"],
]
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvserve"


def imports(module: str, type_checking: bool = False) -> set[str]:
    """The kvserve modules `module` imports; those in `if TYPE_CHECKING:` blocks only with
    `type_checking`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: imports(module) for module in MODULES}
TYPED_GRAPH = {module: imports(module, type_checking=True) for module in MODULES}


def test_every_unit_has_a_layer():
    assert {unit(m) for m in MODULES} == set(LEVEL)


def test_packages_import_only_packages_below_them():
    upward = [
        f"{a} imports {b} ({unit(b)} is not below {unit(a)})"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if unit(a) != unit(b) and LEVEL[unit(b)] <= LEVEL[unit(a)]
    ]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_its_way_back_to_itself():
    cycle = find_cycle(TYPED_GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "graph,cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_rules_read_lazy_imports_and_type_checking_ones_where_they_count():
    # tiers/engine_side.py names the engine's RuntimeInfo under TYPE_CHECKING only (an upward name the
    # layer rule allows); builder.py imports models lazily
    assert "kvserve.engine.builder" not in GRAPH["kvserve.tiers.engine_side"]
    assert "kvserve.engine.builder" in TYPED_GRAPH["kvserve.tiers.engine_side"]
    assert "kvserve.tiers.manager" in GRAPH["kvserve.engine.stats"]
    assert any(m.startswith("kvserve.models.") for m in GRAPH["kvserve.engine.builder"])


# The config slices a package between the engine and the config may read (kvserve/config_slices.py);
# none of them reads ServeConfig
SLICES_READ = {
    "kvcache": {"CacheConfig"},
    "scheduler": {"SchedulerConfig", "CacheConfig"},
    "reuse": {"ReuseConfig"},
    "tiers": {"TierConfig"},
}
BELOW_THE_ENGINE = {unit for unit, level in LEVEL.items() if LEVEL["engine"] < level < LEVEL["config"]}


def config_names(module: str) -> set[str]:
    """The names `module` imports from kvserve.config and kvserve.config_slices, each as module:name."""
    tree = ast.parse(MODULES[module].read_text())
    return {
        f"{node.module}:{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("kvserve.config", "kvserve.config_slices")
        for alias in node.names
    }


def test_parts_below_the_engine_read_only_their_own_slice_of_the_config():
    wrong = [
        f"{module} imports {name}"
        for module in sorted(MODULES)
        if unit(module) in BELOW_THE_ENGINE
        for name in sorted(config_names(module))
        if not name.startswith("kvserve.config_slices:")
        or name.split(":")[1] not in SLICES_READ.get(unit(module), set())
    ]
    assert not wrong, "\n".join(wrong)
    assert config_names("kvserve.kvcache.manager") == {"kvserve.config_slices:CacheConfig"}


SCRIPTS = ROOT.parent / "scripts"


def script_module(path: Path) -> str:
    """A module of scripts/ by its path relative to scripts/, dots for folders; a package by its name."""
    parts = path.relative_to(SCRIPTS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SCRIPT_MODULES = {script_module(p): p for p in SCRIPTS.rglob("*.py")}
# The shared parts: the benchmarks' harness and the servers' launcher. Every other module is a script.
SHARED = ("harness", "peers")


def is_script(module: str) -> bool:
    return module.split(".")[0] not in SHARED


def script_module_imports(source: str, module: str, modules: dict[str, Path] | None = None) -> set[str]:
    """The scripts/ modules that `module` (its source) imports, lazy imports too. Names resolve as the
    scripts import them, scripts/ being on their path: `import harness.machine`, `from harness.machine
    import describe` and `from harness import machine` all name harness.machine; a relative import
    resolves from the module's own package; and a bare name that is no module of scripts/ itself but
    the module of exactly one of its folders (which a script put on its path, as scripts/gpu/) names
    that module."""
    modules = SCRIPT_MODULES if modules is None else modules
    nested: dict[str, list[str]] = {}
    for m in modules:
        if "." in m:
            nested.setdefault(m.rpartition(".")[2], []).append(m)
    path = modules.get(module)
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if (
                top not in modules
                and len(nested.get(top, [])) == 1
                and not any(m.startswith(top + ".") for m in modules)
            ):
                name = nested[top][0] + name[len(top) :]
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def script_imports() -> dict[str, set[str]]:
    """scripts/: each module (path relative to scripts/, dots for folders) -> the scripts/ modules it
    imports (script_module_imports)."""
    return {m: script_module_imports(p.read_text(), m) for m, p in SCRIPT_MODULES.items()}


def scripts_imported(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a script, by any module: a script imports the shared parts only, never another
    script, and the shared parts import no script."""
    return [
        f"{a} imports {b}" for a, targets in sorted(graph.items()) for b in sorted(targets) if is_script(b)
    ]


def test_no_script_imports_its_way_back_to_itself():
    graph = script_imports()
    assert "harness.report" in graph["bench_compare"]  # the check sees the scripts' imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_a_script_imports_the_harness_never_another_script():
    """Every script under scripts/ (scripts/*.py, scripts/gpu/*.py) imports the benchmarks' shared parts
    (scripts/harness/, the servers' launcher scripts/peers/launch.py) and no other script; the
    harness imports no script."""
    graph = script_imports()
    wrong = scripts_imported(graph)
    assert not wrong, "\n".join(wrong)
    # the check sees each form of import: from harness.x import y, from harness import x, lazy ones,
    # relative ones, and the scripts' own modules
    assert {"harness.machine", "harness.report", "peers.launch"} <= graph["bench_fairness"]
    assert "harness.kv_quality" in graph["kv_lever_experiments"]
    assert {"harness.weights_engine", "harness.weights_auto", "harness.compare"} <= graph["bench_weights"]
    assert {"harness.compare", "harness.report"} <= graph["harness.vllm_report"]
    assert "harness.gpu" in graph["gpu.env_report"]
    assert {m for m in graph if "." not in m and is_script(m)} >= {"bench_serving", "soak", "weights_engine"}
    assert scripts_imported({**graph, "harness.serving": {"bench_serving"}}) == [
        "harness.serving imports bench_serving"
    ]


@pytest.mark.parametrize(
    "source,module,found",
    [
        ("from harness.machine import describe", "bench_x", {"harness.machine"}),
        ("from harness import machine, report as r", "bench_x", {"harness.machine", "harness.report"}),
        ("import harness.serving as bs\nimport harness", "bench_x", {"harness.serving", "harness"}),
        ("def f():\n    from bench_serving import percentile", "bench_x", {"bench_serving"}),
        ("import bench_kv_quality as b", "kv_lever_experiments", {"bench_kv_quality"}),
        ("from peers.launch import running\nfrom peers import launch", "bench_x", {"peers.launch"}),
        ("from env_report import ceilings", "bench_kernels", {"gpu.env_report"}),  # gpu/ put on the path
        (
            "from .report import fmt\nfrom . import texts",
            "harness.compare",
            {"harness.report", "harness.texts"},
        ),
        (
            "import torch\nfrom kvserve import LLM\nfrom harness.machine import describe",
            "harness.machine",
            set(),
        ),
    ],
)
def test_the_script_graph_reads_each_form_of_import(source, module, found):
    assert script_module_imports(source, module) == found


def test_content_reuse_is_reached_through_its_interface_only():
    """Outside kvserve/reuse/, modules import the package (its interface, kvserve/reuse/__init__.py),
    never its modules: matching, repair plans, moving KV in, probes and audits are its own."""
    inside = [
        f"{module} imports {target}"
        for module in sorted(MODULES)
        if unit(module) != "reuse"
        for target in sorted(TYPED_GRAPH[module])
        if unit(target) == "reuse" and target != "kvserve.reuse"
    ]
    assert not inside, "\n".join(inside)
    assert "kvserve.reuse" in GRAPH["kvserve.scheduler.admission"]  # the check sees the package's imports


def test_the_scheduled_rows_name_their_types():
    """ScheduledSeq, the scheduler's hand-off to the model runner, types every field (no Any)."""
    tree = ast.parse(MODULES["kvserve.scheduler.batch"].read_text())
    seq = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ScheduledSeq")
    annotations = [ast.unparse(n.annotation) for n in seq.body if isinstance(n, ast.AnnAssign)]
    assert len(annotations) >= 8
    assert not [a for a in annotations if "Any" in a], annotations


MAX_LINES = 400


def test_no_file_in_kvserve_is_over_the_line_limit():
    """A file over MAX_LINES does several jobs (issue 65): split it by job."""
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
    assert (
        max(len(p.read_text().splitlines()) for p in MODULES.values()) > MAX_LINES // 2
    )  # it reads the files

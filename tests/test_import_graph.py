"""The project's import graph, read from the source (nothing is imported): no cycle among the
imports that run when a module loads (module level, ``TYPE_CHECKING`` blocks aside), none either
counting the imports inside functions, and the floors hold at every import: ``ciera`` imports
neither ``megatron`` nor ``tools``, ``megatron.ciera`` not ``tools``, and the binding
(``megatron.ciera.binding``) never the application (``megatron.ciera.app``)
(``docs/architecture.md``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ciera", "megatron/ciera", "tools")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, *, load_time_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(nodes, top: bool):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import) and (top or not load_time_only):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (top or not load_time_only):
                base = _resolve(module, is_pkg, node)
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), top=isinstance(node, ast.ClassDef) and top)
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                visit(ast.iter_child_nodes(node), top)

    visit(tree.body, top=True)
    return out


def _graph(*, load_time_only: bool) -> dict[str, set[str]]:
    """Edges between project modules; a module's own ancestor packages are left out (Python has them
    loaded, or loading, before any of their modules: ``from . import x`` needs only ``x``)."""
    mods = _modules()

    def ancestor(pkg: str, m: str) -> bool:
        return m.startswith(pkg + ".")

    return {m: {i for i in _imports(m, p, load_time_only=load_time_only)
                if i in mods and i != m and not ancestor(i, m)} for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := dfs(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := dfs(u)):
            return found
    return None


def test_the_walk_sees_the_project():
    g = _graph(load_time_only=True)
    assert {"ciera.gather", "ciera.agreement", "megatron.ciera.app.training", "megatron.ciera.binding.bucket_group",
            "tools.sim.simulate"} <= set(g)
    assert "ciera.agreement" in g["ciera.gather"]
    # a function-local import is an edge of the full graph only
    assert "megatron.ciera.binding.fsdp2" not in g["megatron.ciera.binding.engines"]
    assert "megatron.ciera.binding.fsdp2" in _graph(load_time_only=False)["megatron.ciera.binding.engines"]


def test_no_import_cycle_at_load_time():
    cycle = _cycle(_graph(load_time_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_counting_function_local_imports():
    """A cycle closed by an import inside a function loads today, but ties the modules together
    all the same: a layer could no longer be read, tested or moved without the other."""
    cycle = _cycle(_graph(load_time_only=False))
    assert cycle is None, "import cycle (function-local imports counted): " + " -> ".join(cycle)


def test_the_loop_names_no_engine():
    """The training loop calls the run's ``Binding`` (``binding_for``), never an engine's module."""
    engines = {f"megatron.ciera.binding.{m}" for m in ("bucket_group", "fsdp2", "megatron_fsdp", "sharded_binding")}
    imported = _imports("megatron.ciera.app.training", _modules()["megatron.ciera.app.training"], load_time_only=False)
    assert not imported & engines, sorted(imported & engines)


def test_floors_hold_at_every_import():
    for module, path in _modules().items():
        imported = _imports(module, path, load_time_only=False)
        if module.startswith("ciera"):
            bad = [i for i in imported if i.split(".")[0] in ("megatron", "tools")]
        elif module.startswith("megatron.ciera.binding"):
            bad = [i for i in imported if i.split(".")[0] == "tools" or i.startswith("megatron.ciera.app")]
        elif module.startswith("megatron.ciera"):
            bad = [i for i in imported if i.split(".")[0] == "tools"]
        else:
            bad = []
        assert not bad, (f"{module} imports {bad} (floors, bottom up: ciera, megatron.ciera.binding, "
                         "megatron.ciera.app; tools on top)")


def test_the_cycle_finder_bites():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _is_testing(name: str) -> bool:
    return name == "ciera.testing" or name.startswith("ciera.testing.")


def test_the_library_never_imports_its_test_fixtures():
    """``ciera.testing`` (the gloo harness, the synthetic trajectories, the tiny MoE) serves tests, tools
    and examples: no module of ``ciera`` outside it imports it, at load time or later, by statement or
    by name (``importlib.import_module("ciera.testing...")``)."""
    library = {m: p for m, p in _modules().items() if m.split(".")[0] == "ciera" and not _is_testing(m)}
    assert "ciera.measure" in library and "ciera.testing" in _modules()
    for module, path in library.items():
        bad = [i for i in _imports(module, path, load_time_only=False) if _is_testing(i)]
        bad += [node.value for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_testing(node.value)]
        assert not bad, f"{module} imports {bad}: the library must not depend on its test fixtures"

"""The engine's import graph has no cycle: every import a module runs (at load or inside a
function; those under ``if TYPE_CHECKING:`` only name types) is followed, and a module that can
reach itself fails the test, with the cycle in the message."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def engine_modules() -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / "engine").rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def runtime_imports(name: str, tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """The engine modules ``name`` imports when it runs (relative imports resolved)."""
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for sub in node.body for n in ast.walk(sub))
    package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def engine_graph() -> dict[str, set[str]]:
    modules = engine_modules()
    return {
        m: runtime_imports(m, ast.parse(f.read_text(), str(f)), modules) for m, f in modules.items()
    }


def test_the_engine_has_no_import_cycle():
    graph = engine_graph()
    assert "engine.model.runner" in graph and graph["engine.round.speculator"]  # the walk ran
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_lazy_import_cycle():
    """The check on a made-up graph: a lazy import that closes a loop is a cycle too."""
    tree_a = ast.parse("from engine.b import x\n")
    tree_b = ast.parse("def f():\n    from engine.a import y\n")
    tree_c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.a\n")
    modules = {"engine.a": Path("a.py"), "engine.b": Path("b.py"), "engine.c": Path("c.py")}
    graph = {
        "engine.a": runtime_imports("engine.a", tree_a, modules),
        "engine.b": runtime_imports("engine.b", tree_b, modules),
        "engine.c": runtime_imports("engine.c", tree_c, modules),
    }
    assert graph["engine.c"] == set()  # a type-only import is no edge
    assert cycles(graph) == [["engine.a", "engine.b"]]

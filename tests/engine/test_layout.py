"""The engine's layout as its imports draw it, and the text that describes it.

- **Layers.** Imports point down, never up: plain records at the bottom (with the two leaves every
  layer uses, transfer and fallback), then the KV memory, the model and the sampling transforms
  (the machines), then K control, the drafters, the requests (scheduler, prefill) and the round
  (policy), then the engine's top modules (the engine, its builder and config), the worker
  thread, and on top the one door the server uses, ``engine.api``. Every import counts: at
  load, inside a function, and under ``if TYPE_CHECKING:`` (a type-only import still makes a
  reader of the lower module learn the upper one).
- **No cycle** between modules, with the same imports.
- ``server/`` imports the engine only through ``engine.api``.
- No function of ``engine/`` takes more than 8 positional parameters (keywords or a record past
  that).
- Every file a docstring, a comment or a doc names exists, and every ``engine.…`` dotted name a
  docstring or comment of the code gives resolves.

Each check is also run on a made-up case it must fail, so that none passes vacuously.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

from tests.helpers import repo_files

ROOT = Path(__file__).resolve().parents[2]

# bottom to top; a module belongs to the longest prefix that names it
LAYERS = [
    ("engine.records", "engine.transfer", "engine.fallback"),
    ("engine.kv",),
    ("engine.model",),
    ("engine.sampling",),
    ("engine.kcontrol",),
    ("engine.drafters",),
    ("engine.requests",),
    ("engine.round",),
    ("engine.protocol", "engine.config", "engine.engine", "engine.builder", "engine"),
    ("engine.worker",),
    ("engine.api",),
]


def engine_modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for f in sorted((root / "engine").rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(name: str, tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """The engine modules ``name`` imports: at load, in a function or for types only (relative
    imports resolved; ``from package import module`` is the module)."""
    package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
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


def engine_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = engine_modules(root)
    return {m: imports(m, ast.parse(f.read_text(), str(f)), modules) for m, f in modules.items()}


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


def layer(module: str) -> tuple[int, str]:
    """(the layer's index, the package) of ``module``: the longest prefix :data:`LAYERS` names."""
    best = (-1, "")
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (i, prefix)
    assert best[0] >= 0, f"{module} is in no layer of LAYERS"
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports that point up the layers (or across packages of one layer's rank)."""
    out = []
    for src, targets in sorted(graph.items()):
        (ls, ps) = layer(src)
        for dst in sorted(targets):
            (ld, pd) = layer(dst)
            if ld > ls:
                out.append(f"{src} -> {dst} ({ps} is below {pd})")
    return out


def test_imports_point_down_the_layers():
    graph = engine_graph()
    assert graph["engine.round.speculator"] and graph["engine.model.runner"]  # the walk ran
    bad = upward(graph)
    assert not bad, "imports pointing up: " + "; ".join(bad)


def test_the_engine_has_no_import_cycle():
    found = cycles(engine_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_records_import_only_records():
    graph = engine_graph()
    records = [m for m in graph if m.startswith("engine.records")]
    assert len(records) >= 5
    for m in records:
        assert all(t.startswith("engine.records") for t in graph[m]), (m, graph[m])


def test_the_checks_see_lazy_type_only_and_upward_imports():
    """On made-up modules: a lazy import and a type-only one close a cycle each, and a record
    importing the round points up."""
    sources = {
        "engine.a": "from engine.b import x\n",
        "engine.b": "def f():\n    from engine.a import y\n",
        "engine.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.d\n",
        "engine.d": "from engine import c\n",
        "engine.records.r": "from engine.round.speculator import Speculator\n",
        "engine.round.speculator": "from engine.records.r import R\n",
    }
    modules = {m: Path(m.rpartition(".")[2] + ".py") for m in sources}
    graph = {m: imports(m, ast.parse(src), modules) for m, src in sources.items()}
    assert graph["engine.c"] == {"engine.d"}  # a type-only import is an edge
    assert cycles(graph) == [
        ["engine.a", "engine.b"],
        ["engine.c", "engine.d"],
        ["engine.records.r", "engine.round.speculator"],
    ]
    assert upward(graph) == [
        "engine.records.r -> engine.round.speculator (engine.records is below engine.round)"
    ]


def engine_imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "engine":
            out.add(node.module or "")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "engine")
    return out


def test_the_server_enters_the_engine_by_one_door():
    seen = {f.name: engine_imports_of(f) for f in sorted((ROOT / "server").rglob("*.py"))}
    assert any(seen.values())  # the server does import the engine
    other = {f: m - {"engine.api"} for f, m in seen.items() if m - {"engine.api"}}
    assert not other, f"server modules importing past engine.api: {other}"


def positional(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """Positional parameters of a function, a method's ``self`` / ``cls`` not counted."""
    n = len(node.args.posonlyargs) + len(node.args.args)
    static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
    return n - 1 if in_class and not static and n else n


def long_signatures(tree: ast.Module, where: str) -> list[str]:
    out = []

    def walk(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := positional(child, in_class)) > 8:
                    out.append(f"{where}:{child.lineno} {child.name} ({n} positional)")
                walk(child, False)
            else:
                walk(child, isinstance(child, ast.ClassDef))

    walk(tree, False)
    return out


def test_no_engine_function_takes_more_than_8_positional_parameters():
    found = []
    for f in sorted((ROOT / "engine").rglob("*.py")):
        found += long_signatures(ast.parse(f.read_text()), str(f.relative_to(ROOT)))
    assert not found, "pass these by keyword or in a record: " + "; ".join(found)


def test_the_signature_check_counts_positional_parameters():
    src = (
        "def f(a, b, c, d, e, f, g, h, i): ...\n"
        "def g(a, b, c, d, e, f, g, h, *, i): ...\n"
        "class C:\n    def m(self, a, b, c, d, e, f, g, h): ...\n"
        "    def n(self, a, b, c, d, e, f, g, h, i): ...\n"
    )
    assert long_signatures(ast.parse(src), "x.py") == [
        "x.py:1 f (9 positional)",
        "x.py:5 n (9 positional)",
    ]


# --- the text: files and dotted names it gives --------------------------------------------------
# names of other projects that look like files (llama.cpp itself, its converter, the Prometheus
# chart's template, a CRD's API group, Helm's annotation domain)
ELSEWHERE = {
    "llama.cpp",
    "convert_hf_to_gguf.py",
    "templates/prometheus/prometheus.yaml",
    "keda.sh",
    "helm.sh",
}
FILE_REF = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|yaml|yml|sh|cpp|toml))\b")
DOTTED = re.compile(r"(?<![\w.])(engine(?:\.\w+)+)")


def text_lines(path: Path) -> list[tuple[int, str]]:
    """A doc's lines, or a Python file's docstrings and comments, with their line numbers."""
    src = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(src.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        prose = tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in ('"""', "'''")
        )
        if prose:
            out += [(tok.start[0] + j, line) for j, line in enumerate(tok.string.splitlines())]
    return out


def dotted_resolves(ref: str, files: set[str]) -> bool:
    """``engine.<package>.<module>[.<name>]``: the module exists and names ``<name>``."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        stem = "/".join(parts[:i])
        for cand in (f"{stem}.py", f"{stem}/__init__.py"):
            if cand in files:
                if i == len(parts):
                    return True
                return re.search(rf"\b{parts[i]}\b", (ROOT / cand).read_text()) is not None
    return False


def stale_references(paths: list[str], files: list[str]) -> list[str]:
    names = set(files)
    out = []
    for f in paths:
        for line_no, line in text_lines(ROOT / f):
            for m in FILE_REF.finditer(line):
                ref = m.group(1)
                if ref not in ELSEWHERE and not any(
                    x == ref or x.endswith("/" + ref) for x in names
                ):
                    out.append(f"{f}:{line_no} {ref}")
            if f.endswith(".py"):
                for m in DOTTED.finditer(line):
                    if m.group(1).endswith((".py", ".md")):
                        continue  # a file (above)
                    if not dotted_resolves(m.group(1).rstrip("."), names):
                        out.append(f"{f}:{line_no} {m.group(1)}")
    return out


def test_every_file_and_name_the_text_gives_exists():
    files = repo_files()
    code = ("engine/", "server/", "train/", "loadtest/", "tests/", "prompts/", "scripts/")
    paths = [
        f
        for f in files
        if (f.startswith(code) and f.endswith(".py"))
        or (f.endswith(".md") and not f.startswith("loadtest/results/"))
        or (f.startswith("configs/") and f.endswith((".yaml", ".yml")))
    ]
    assert len(paths) > 200
    stale = stale_references(paths, files)
    assert not stale, "the text names what is not there: " + "; ".join(stale)


def test_the_text_check_finds_a_stale_name(tmp_path, monkeypatch):
    f = tmp_path / "made_up.py"
    f.write_text('"""See engine/round/k_control.py and engine.round.speculator.nothing_here."""\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    files = ["made_up.py", "engine/round/speculator.py"]
    (tmp_path / "engine" / "round").mkdir(parents=True)
    (tmp_path / "engine" / "round" / "speculator.py").write_text("class Speculator: ...\n")
    got = stale_references(["made_up.py"], files)
    assert got == [
        "made_up.py:1 engine/round/k_control.py",
        "made_up.py:1 engine.round.speculator.nothing_here",
    ]

"""The shape of the house (docs/architecture.md): no import cycle among runtime modules, no
function over 60 lines anywhere in src/meshzero, at most 12 files at the package top level,
and nothing outside ``meshzero.deepspeed`` imports it.

``python -m tests.test_architecture`` prints the figures (top-level files, cycles, the
longest functions) for a closing note.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "meshzero"
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module, deferred: bool) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run: module level (also inside try/if blocks) and, with ``deferred``,
    those inside functions; never those under ``if TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo += node.orelse
        elif deferred or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                        | ast.ClassDef | ast.Lambda):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(deferred: bool = True) -> dict[str, set[str]]:
    """``{module: meshzero modules it imports}``: at import time, and with ``deferred``
    also inside functions (a loop hidden in a function is still a loop)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in _runtime_imports(ast.parse(path.read_text()), deferred):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("meshzero") and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan); a package
    importing its own submodules from ``__init__`` is not a cycle, so edges from a module to
    the package that contains it are left out."""
    def edges(v: str) -> set[str]:
        return {w for w in graph[v] if not v.startswith(w + ".")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str]]:
    """``(lines, "path:function")`` of every function longer than ``limit`` lines (from
    ``def`` to its last line, decorators and docstring included), longest first."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(PACKAGE)}:{node.name}"))
    return sorted(found, reverse=True)


def top_level_files() -> list[str]:
    return sorted(p.name for p in PACKAGE.glob("*.py"))


MAX_TOP_LEVEL_FILES = 12


def test_top_level_stays_small():
    files = top_level_files()
    assert len(files) <= MAX_TOP_LEVEL_FILES, f"{len(files)} files at the top level: {files}"


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_no_long_functions():
    offenders = long_functions()
    assert offenders == [], f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def test_only_the_deepspeed_map_imports_itself():
    """``meshzero.deepspeed`` is a map onto meshzero's API (docs/migration.md): no other
    module of the package may depend on it."""
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if not m.startswith("meshzero.deepspeed")
                   and any(d == "meshzero.deepspeed" or d.startswith("meshzero.deepspeed.")
                           for d in deps))
    assert users == [], f"modules outside meshzero.deepspeed that import it: {users}"


if __name__ == "__main__":
    files = top_level_files()
    print(f"top-level files: {len(files)}: {' '.join(files)}")
    print(f"import cycles at import time: {import_cycles(import_graph(deferred=False))}")
    print(f"import cycles with imports inside functions: {import_cycles(import_graph())}")
    for n, where in long_functions(40)[:15]:
        print(f"{n:4d}  {where}")

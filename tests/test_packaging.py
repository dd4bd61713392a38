"""The package as pip sees it: every third-party module the source imports is declared in
pyproject.toml (an undeclared one is only found in a fresh environment: .ci/fresh-env runs
that check in CI; this one is static and fast), an optional extra's module is imported only
where its absence is handled, the version has one source, py.typed and LICENSE ship."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import meshzero
from tests.distributed import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

SRC = REPO_ROOT / "src" / "meshzero"


def _name(requirement: str) -> str:
    """'torch>=2.5' -> 'torch'; distribution names compared normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(top-level module, whether an ImportError around it is handled) of each absolute
    import, TYPE_CHECKING-only imports left out."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Try) and any(
                h.type is not None and re.search(r"\b(ImportError|ModuleNotFoundError)\b",
                                                 ast.unparse(h.type)) for h in node.handlers):
            for child in node.body:
                visit(child, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], guarded) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], guarded))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return found


def test_every_imported_distribution_is_declared():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    # what the declared dependencies themselves require (pydantic brings pydantic-core)
    brought = {_name(r) for d in runtime for r in importlib.metadata.requires(d) or []
               if "extra ==" not in r}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        for module, guarded in _imports(ast.parse(path.read_text())):
            if module in sys.stdlib_module_names or module == "meshzero":
                continue
            names = {_name(d) for d in distributions.get(module, [module])}
            where = path.relative_to(REPO_ROOT)
            if names & (runtime | brought):
                continue
            if names & extras and guarded:
                continue
            problems.append(f"{where}: imports {module} ({', '.join(sorted(names))}), "
                            + ("an extra, without handling its absence" if names & extras
                               else "not declared in pyproject.toml"))
    assert not problems, "\n".join(problems)


def test_version_py_typed_and_license():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]  # read from meshzero.__version__
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "meshzero.__version__"}
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["meshzero"]
    assert (SRC / "py.typed").is_file()
    assert re.fullmatch(r"\d+\.\d+\.\d+", meshzero.__version__)
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert project["project"]["license"] == "Apache-2.0"
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def test_public_api_loads_on_first_use():
    """``import meshzero`` is light; the public names resolve (and are in __all__)."""
    for name in meshzero.__all__:
        assert getattr(meshzero, name) is not None
    assert set(meshzero.__all__) <= set(dir(meshzero))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshzero.nope  # noqa: B018
    assert Path(meshzero.__file__).parent == SRC

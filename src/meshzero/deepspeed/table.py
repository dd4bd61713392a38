"""The DeepSpeed API -> meshzero table, rendered from the code so the docs cannot drift.

    python -m meshzero.deepspeed.table docs/migration.md   # rewrite the section in place

Every public name of ``meshzero.deepspeed`` is walked: the names of each lazy ``_EXPORTS``
map (a module named there is walked in turn), a module's ``__all__`` (or the functions and
classes it defines), the submodules of a package that declares neither (DeepSpeed's import
paths, ``deepspeed.runtime.zero.partition_parameters``), and the methods ``DeepSpeedEngine``
adds to ``meshzero.Engine``. Each row is the first line of the name's docstring ("DeepSpeed's
`x`: what it is here", continued while the sentence is), the ``DeepSpeed's `x`:`` part dropped;
a name re-exported from torch is shown as such.

A module named in an ``_EXPORTS`` map that cannot be imported is an error (the table would
silently lose names). While the modules are being written, ``--allow-missing`` (or
``MESHZERO_API_TABLE_ALLOW_MISSING=1``) skips them with one line each on stderr.
The section sits between ``<!-- api-table:start -->`` and ``<!-- api-table:end -->``; the
rest of the file is kept (the section is appended when the markers are absent).
tests/test_deepspeed_table.py fails when the docs copy is not what ``render`` gives.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "meshzero.deepspeed"
START, END = "<!-- api-table:start -->", "<!-- api-table:end -->"
ALLOW_ENV = "MESHZERO_API_TABLE_ALLOW_MISSING"
_PREFIX = re.compile(r"^DeepSpeed's `[^`]+`\s*:\s*")
_SKIP_MODULES = {f"{PACKAGE}.table"}


class MissingModuleError(ImportError):
    """A module named in an ``_EXPORTS`` map could not be imported."""


@dataclass(frozen=True)
class Row:
    name: str  # the DeepSpeed spelling: deepspeed.x.y or DeepSpeedEngine.m
    text: str  # what it is in meshzero (the docstring's first line, prefix dropped)
    documented: bool  # the docstring's first line starts with "DeepSpeed's `...`:"


def _first_line(obj: Any) -> tuple[str, bool]:
    """(the row's text, whether it follows the convention); a value that cannot carry a
    docstring (a constant, a logger) is described and counts as documented."""
    if isinstance(obj, property):
        obj = obj.fget
    if not _has_own_doc(obj):
        return _describe_value(obj), True
    home = getattr(obj, "__module__", None) or ""
    if not inspect.ismodule(obj) and not home.startswith("meshzero"):
        return f"`{home}.{obj.__qualname__}`, as it is", True  # re-exported as it is
    doc = obj.__doc__
    if not doc or not doc.strip():
        return "(no docstring)", False
    line = _first_sentence(inspect.cleandoc(doc).splitlines())
    match = _PREFIX.match(line)
    return (line[match.end():] if match else line), bool(match)


def _first_sentence(lines: list[str]) -> str:
    """The first line, continued while it does not end a sentence (a wrapped first line)."""
    out = lines[0].strip()
    for nxt in lines[1:4]:
        if not nxt.strip() or out.endswith((".", ":", ")")):
            break
        out = f"{out} {nxt.strip()}"
    return out


def _has_own_doc(obj: Any) -> bool:
    return inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)


def _describe_value(obj: Any) -> str:
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return f"constant `{obj!r}`"
    if getattr(obj, "__origin__", None) is not None:
        return "a type alias (for annotations)"
    if isinstance(obj, (list, tuple, frozenset, set)):
        return f"constant {type(obj).__name__} of {len(obj)}"
    return f"a `{type(obj).__module__}.{type(obj).__qualname__}`"


class _Walker:
    def __init__(self, allow_missing: bool) -> None:
        self.allow_missing = allow_missing
        self.rows: dict[str, Row] = {}
        self.seen: set[str] = set()
        self.missing: list[str] = []

    def module(self, module_name: str, required_by: str | None) -> ModuleType | None:
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:
            if required_by is None:
                raise
            where = f"{module_name} (named in {required_by}._EXPORTS): {exc}"
            if not self.allow_missing:
                raise MissingModuleError(f"cannot import {where}; pass --allow-missing or "
                                         f"set {ALLOW_ENV}=1 while it is being written") from exc
            if where not in self.missing:
                self.missing.append(where)
            return None

    def add(self, name: str, obj: Any) -> None:
        if name not in self.rows:
            text, documented = _first_line(obj)
            self.rows[name] = Row(name, text, documented)

    def walk(self, module: ModuleType, ds_name: str) -> None:
        """Rows for the public names of ``module``, spelled from ``ds_name``."""
        if module.__name__ in self.seen or module.__name__ in _SKIP_MODULES:
            return
        self.seen.add(module.__name__)
        exports: dict[str, str] | None = vars(module).get("_EXPORTS")  # no module __getattr__
        if exports is not None:
            self._walk_exports(module, ds_name, exports)
        else:
            for attr, obj in _own_public(module):
                if inspect.ismodule(obj) and obj.__name__.startswith(PACKAGE):
                    self.walk(obj, f"{ds_name}.{attr}")  # a submodule listed in __all__
                else:
                    self.add(f"{ds_name}.{attr}", obj)
        if exports is not None or "__all__" in vars(module):
            return  # a declared surface: its other submodules are meshzero's own
        for sub in _submodules(module):
            child = self.module(f"{module.__name__}.{sub}", None)
            if child is not None:
                self.walk(child, f"{ds_name}.{sub}")

    def _walk_exports(self, module: ModuleType, ds_name: str, exports: dict[str, str]) -> None:
        for attr, target in sorted(exports.items()):
            is_module = target.endswith(":")
            found = self.module(target.rstrip(":"), module.__name__)
            if found is None:
                continue
            if is_module:
                self.walk(found, f"{ds_name}.{attr}")
            else:
                self.add(f"{ds_name}.{attr}", getattr(found, attr))


def _own_public(module: ModuleType) -> Iterator[tuple[str, Any]]:
    """``__all__``, or the public functions and classes the module defines itself."""
    names = vars(module).get("__all__")
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or inspect.isclass(v))
                 and getattr(v, "__module__", None) == module.__name__]
    for name in sorted(names):
        yield name, getattr(module, name)


def _submodules(module: ModuleType) -> list[str]:
    path = getattr(module, "__path__", None)
    if path is None:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))


def engine_rows() -> list[Row]:
    """The methods and properties ``DeepSpeedEngine`` adds to ``meshzero.Engine`` (a
    single-underscore name too, when its docstring names the DeepSpeed method)."""
    from meshzero.engine import Engine

    engine_cls = importlib.import_module(PACKAGE).DeepSpeedEngine
    rows: dict[str, Row] = {}
    for klass in engine_cls.__mro__:
        if klass is Engine or klass is object:
            break
        for attr, obj in vars(klass).items():
            if attr.startswith("__") or attr in rows or hasattr(Engine, attr):
                continue
            if not (inspect.isfunction(obj) or isinstance(obj, (property, staticmethod,
                                                                 classmethod))):
                continue
            func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
            text, documented = _first_line(func)
            if attr.startswith("_") and not documented:
                continue
            rows[attr] = Row(f"DeepSpeedEngine.{attr}", text, documented)
    return [rows[k] for k in sorted(rows)]


def collect(allow_missing: bool | None = None) -> tuple[list[Row], list[Row], list[str]]:
    """(module rows, engine rows, modules skipped as missing)."""
    if allow_missing is None:
        allow_missing = os.environ.get(ALLOW_ENV, "") not in ("", "0")
    walker = _Walker(allow_missing)
    root = importlib.import_module(PACKAGE)
    walker.add("deepspeed.__version__", root.__version__)
    walker.walk(root, "deepspeed")
    engine: list[Row] = []
    try:
        engine = engine_rows()
    except (ImportError, AttributeError) as exc:
        if not allow_missing:
            raise
        walker.missing.append(f"DeepSpeedEngine: {exc}")
    return sorted(walker.rows.values(), key=lambda r: r.name), engine, walker.missing


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=96, break_on_hyphens=False, break_long_words=False)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


INTRO = (
    "With `import meshzero.deepspeed as deepspeed` a DeepSpeed script keeps its calls. These "
    "are the names it finds (DeepSpeed's API level {version}: `deepspeed.__version__` answers "
    "version gates with it), each with what it is in meshzero; a name that cannot be honoured "
    "raises one line naming the meshzero way. A `from deepspeed.x import y` line becomes "
    "`from meshzero.deepspeed.x import y`. Generated from the docstrings of "
    "`meshzero.deepspeed`.")
ENGINE_INTRO = (
    "`deepspeed.initialize` returns a `DeepSpeedEngine`: meshzero's `Engine` (its `backward`, "
    "`step`, `save_checkpoint`, `load_checkpoint`, ... keep DeepSpeed's names, see "
    "[Usage](usage.md)) with these methods added; any other attribute falls through to the "
    "model, as in DeepSpeed.")


def render(allow_missing: bool | None = None) -> str:
    """The section, markers included."""
    rows, engine, _ = collect(allow_missing)
    version = importlib.import_module(PACKAGE).__version__
    out = [START, "<!-- generated: python -m meshzero.deepspeed.table docs/migration.md -->",
           "## DeepSpeed API -> meshzero", "", _wrap(INTRO.format(version=version)), "",
           "| DeepSpeed name | in meshzero |", "| --- | --- |"]
    out += [f"| `{r.name}` | {_cell(r.text)} |" for r in rows]
    out += ["", "### The engine", "", _wrap(ENGINE_INTRO), "",
            "| method | in meshzero |", "| --- | --- |"]
    out += [f"| `{r.name}` | {_cell(r.text)} |" for r in engine]
    out += ["", END]
    return "\n".join(out)


def splice(document: str, section: str) -> str:
    """``document`` with the text between the markers replaced by ``section``."""
    start, end = document.find(START), document.find(END)
    if start == -1 and end == -1:
        return document.rstrip("\n") + "\n\n" + section + "\n"
    if start == -1 or end == -1 or end < start:
        raise ValueError(f"unbalanced {START} / {END} markers")
    return document[:start] + section + document[end + len(END):]


def current_section(document: str) -> str | None:
    """The section between the markers (markers included), or None."""
    start, end = document.find(START), document.find(END)
    if start == -1 or end == -1:
        return None
    return document[start:end + len(END)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m meshzero.deepspeed.table",
        description="Render the DeepSpeed API -> meshzero table into a markdown file "
                    "(between the api-table markers) or print it.")
    parser.add_argument("output", nargs="?", type=Path, default=None,
                        help="the markdown file to update (default: print the section)")
    parser.add_argument("--allow-missing", action="store_true", default=None,
                        help="skip modules named in an _EXPORTS map that cannot be imported "
                             f"(also {ALLOW_ENV}=1)")
    args = parser.parse_args(argv)
    _, _, missing = collect(args.allow_missing)
    for line in missing:
        print(f"skipped (missing): {line}", file=sys.stderr)
    section = render(args.allow_missing)
    if args.output is None:
        print(section)
    else:
        args.output.write_text(splice(args.output.read_text(), section))


if __name__ == "__main__":
    main()

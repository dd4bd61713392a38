"""The DeepSpeed API table in docs/migration.md is the one meshzero.deepspeed renders."""

from __future__ import annotations

import pytest

from meshzero.deepspeed import table
from tests.distributed import REPO_ROOT

DOCS = REPO_ROOT / "docs" / "migration.md"


def test_docs_copy_is_current() -> None:
    """Strict: every module an _EXPORTS map names must import."""
    assert table.current_section(DOCS.read_text()) == table.render(allow_missing=False), (
        "docs/migration.md's API table is stale: run python -m meshzero.deepspeed.table "
        "docs/migration.md")


def test_every_name_has_a_deepspeed_docstring() -> None:
    """DESIGN: each public name's docstring starts "DeepSpeed's `x`: what it is here"."""
    rows, engine, _ = table.collect(allow_missing=False)
    bad = [r.name for r in [*rows, *engine] if not r.documented]
    assert bad == [], f"no \"DeepSpeed's `x`: ...\" first docstring line: {bad}"


def test_a_missing_module_fails_unless_allowed(monkeypatch) -> None:
    walker = table._Walker(allow_missing=False)
    with pytest.raises(table.MissingModuleError, match="meshzero.deepspeed.nope"):
        walker.module("meshzero.deepspeed.nope", "meshzero.deepspeed")
    walker = table._Walker(allow_missing=True)
    assert walker.module("meshzero.deepspeed.nope", "meshzero.deepspeed") is None
    assert walker.missing and "meshzero.deepspeed.nope" in walker.missing[0]
    monkeypatch.setenv(table.ALLOW_ENV, "1")
    table.collect()  # the environment variable tolerates what is not written yet


def test_splice_keeps_the_rest_of_the_file() -> None:
    section = f"{table.START}\nnew\n{table.END}"
    doc = f"# T\n\nintro\n\n{table.START}\nold\n{table.END}\n\n## After\n"
    assert table.splice(doc, section) == f"# T\n\nintro\n\n{section}\n\n## After\n"
    assert table.splice("# T\n", section) == f"# T\n\n{section}\n"
    with pytest.raises(ValueError, match="unbalanced"):
        table.splice(f"# T\n{table.END}\n{table.START}\n", section)


def test_rows_use_the_docstring_after_the_deepspeed_prefix() -> None:
    def documented() -> None:
        """DeepSpeed's `deepspeed.x`: meshzero's y.

        More."""

    def plain() -> None:
        """Something else."""

    documented.__module__ = plain.__module__ = "meshzero.deepspeed.example"
    assert table._first_line(documented) == ("meshzero's y.", True)
    assert table._first_line(plain) == ("Something else.", False)
    assert table._first_line("lamb") == ("constant `'lamb'`", True)
    assert table._first_line(len) == ("`builtins.len`, as it is", True)

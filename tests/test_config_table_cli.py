"""``python -m meshzero.config.table``: a real argument parser (``--help`` once wrote the
table to a file named ``--help``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshzero.config.table import main, render
from tests.distributed import REPO_ROOT


def test_help_prints_usage_and_writes_no_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshzero.config.table", "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m meshzero.config.table")
    assert list(tmp_path.iterdir()) == []


def test_output_path_and_unknown_option(tmp_path, capsys):
    main([str(tmp_path / "keys.md")])
    assert (tmp_path / "keys.md").read_text() == render()
    with pytest.raises(SystemExit) as exc:
        main(["--output-dir", "x"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --output-dir" in capsys.readouterr().err
    assert not (tmp_path / "--output-dir").exists()

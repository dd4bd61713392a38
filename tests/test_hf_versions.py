"""The transformers releases MeshzeroTrainer supports (pyproject's hf extra): the Trainer
internals it overrides are checked at import, naming any a release lacks or reshapes; the
oldest and the newest supported release each run the Trainer tests in a venv of their own
(slow: ``python -m pytest -q -m slow tests/test_hf_versions.py``; it installs the release from
the package registry with pip, a few minutes each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import REPO_ROOT

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

OLDEST, NEWEST = "5.17.0", "5.25.0"


def test_the_installed_release_has_every_internal() -> None:
    from meshzero.hf.trainer import missing_internals

    assert missing_internals(transformers.Trainer) == []


def test_a_release_without_an_internal_fails_naming_it() -> None:
    from meshzero.hf.trainer import INTERNALS, _unsupported, missing_internals

    methods = {name: getattr(transformers.Trainer, name) for name in INTERNALS}
    del methods["_prepare_for_training"]  # dropped by a release
    methods["_wrap_model"] = lambda self, model, training=True: model  # reshaped
    missing = missing_internals(type("Release", (), methods))
    assert [m.split("(")[0].strip() for m in missing] == ["_prepare_for_training", "_wrap_model"]
    message = _unsupported(missing)
    assert transformers.__version__ in message and "_wrap_model" in message
    assert "transformers>=5.17,<6" in message


def test_the_extra_allows_the_tested_range() -> None:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"transformers>=5.17,<6"' in text


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_trainer_tests_pass_on_the_release(version: str, tmp_path: Path) -> None:
    venv = tmp_path / f"transformers-{version}"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    python = venv / "bin" / "python"
    # pip installs the release and, inside the venv only, the dependency versions it needs
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={version}"],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"}
    got = subprocess.run([str(python), "-c", "import transformers; print(transformers."
                          "__version__)"], capture_output=True, text=True, env=env, timeout=300)
    assert got.stdout.strip() == version, got.stderr[-3000:]
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_hf_trainer.py", "tests/test_hf_config.py",
                          "tests/test_hf_versions.py", "-m", "not slow"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stdout[-5000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout

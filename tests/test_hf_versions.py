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
# (trl, peft) releases of the trl extra
TRL_OLDEST, TRL_NEWEST = ("1.14.0", "0.18.0"), ("1.16.0", "0.21.2")


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
    assert text.count('"trl>=1.14,<2", "peft>=0.18"') == 2  # the trl extra and the test extra


def test_an_older_trl_is_refused_naming_the_range(monkeypatch) -> None:
    trl = pytest.importorskip("trl")
    from meshzero.hf import compose

    monkeypatch.setattr(trl, "__version__", "1.12.0")
    with pytest.raises(ImportError, match=r"trl>=1.14,<2"):
        compose.check_trl(trl.SFTTrainer)


def _venv_with(pins: dict[str, str], tmp_path: Path) -> tuple[Path, dict]:
    """A venv over this environment with ``pins`` installed from the package registry (pip
    installs, inside the venv only, the dependency versions they need); checks each."""
    venv = tmp_path / "-".join(f"{k}-{v}" for k, v in pins.items())
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q",
                          *[f"{k}=={v}" for k, v in pins.items()]],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for name, version in pins.items():
        got = subprocess.run([str(python), "-c", f"import {name}; print({name}.__version__)"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert got.stdout.strip() == version, got.stderr[-3000:]
    return python, env


def _run_tests(python: Path, env: dict, *tests: str) -> None:
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                          "-m", "not slow"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stdout[-5000:]
    assert " passed" in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_trainer_tests_pass_on_the_release(version: str, tmp_path: Path) -> None:
    python, env = _venv_with({"transformers": version}, tmp_path)
    _run_tests(python, env, "tests/test_hf_trainer.py", "tests/test_hf_config.py",
               "tests/test_hf_versions.py")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("trl_version,peft_version", [TRL_OLDEST, TRL_NEWEST])
def test_trl_and_peft_tests_pass_on_the_releases(trl_version: str, peft_version: str,
                                                 tmp_path: Path) -> None:
    python, env = _venv_with({"trl": trl_version, "peft": peft_version}, tmp_path)
    _run_tests(python, env, "tests/test_hf_trl.py", "tests/test_hf_save.py")

"""The examples run as a user runs them, in fresh processes: alone and under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.distributed import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "train_minimal.py"
LOSS_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)$", re.MULTILINE)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param([sys.executable], id="single-process"),
        pytest.param([*TORCHRUN, "--nproc-per-node", "2"], id="torchrun-2"),
    ],
)
def test_train_minimal_loss_falls(launcher: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, str(EXAMPLE), "--steps", "10"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    losses = [float(loss) for _, loss in LOSS_LINE.findall(proc.stdout)]
    assert len(losses) >= 2, f"no loss lines in the output:\n{proc.stdout}\n{proc.stderr}"
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    assert "memory on device (bytes):" in proc.stdout and "comm all_gather" in proc.stdout

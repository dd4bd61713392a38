"""benchmarks/compare.py runs end to end, so the side-by-side harness cannot rot (issue 6), and
meshzero's comm_report agrees with the bytes c10d saw; benchmarks/gloo_collectives.py runs;
benchmarks/gpu_check.sh passes its own CPU dry run (slow set).

It launches each system under torchrun with two ranks on a tiny GPT; DeepSpeed is left out
here (it is an optional extra), the table is checked for one row per system and stage.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_compare_runs_and_prints_a_row_per_system_and_stage():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--systems", "meshzero,fsdp2",
           "--steps", "2", "--warmup", "1", "--tiny", "--nproc", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("| ")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header, rows = cells[0], [dict(zip(cells[0], c, strict=False)) for c in cells[1:]]
    assert header[:4] == ["system", "ZeRO", "offload", "step s (median)"], header
    measured = [r for r in rows if re.fullmatch(r"\d+\.\d+", r["step s (median)"])]
    for system in ("meshzero", "fsdp2"):
        for stage in ("2", "3"):
            assert any(r["system"] == system and r["ZeRO"] == stage and r["offload"] == "-"
                       for r in measured), (system, stage, out.stdout)
    assert any(r["system"].startswith("no-comm limit") for r in measured), out.stdout
    # the same seed, data and fp32 AdamW: every sharded system ends at the same loss
    losses = {round(float(r["loss"]), 3) for r in measured if r["system"] in ("meshzero", "fsdp2")}
    assert len(losses) == 1, losses
    # meshzero's count of the bytes it sent equals what c10d saw (its gloo paths included)
    assert "differs from the c10d counter" not in out.stdout, out.stdout


def test_gloo_collectives_runs_and_prints_each_way():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gloo_collectives.py"), "--numel", "1000",
           "--repeat", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    row = next(ln for ln in out.stdout.splitlines() if ln.startswith("| 1,000 |"))
    assert len(re.findall(r"\d+\.\d", row)) == 4, row


@pytest.mark.slow
def test_gpu_check_dry_run_passes_on_cpu():
    """benchmarks/gpu_check.sh --dry-run: bash -n on the script, then every check on CPU with
    tiny models (gloo): the script a GPU machine runs is itself checked here (~1-2 min)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    for check in ("nccl", "bf16", "cpu_offload", "nvme_offload", "gpt_offload", "quantized"):
        assert re.search(rf"^PASS {check}\b", out.stdout, re.M), (check, out.stdout[-4000:])
    assert "MFU" in out.stdout and "gpu_check: all passed" in out.stdout

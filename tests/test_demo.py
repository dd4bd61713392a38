"""``meshzero demo`` as a user runs it: a fresh process that launches its ranks through
PyTorch's elastic launcher. The scaling table is checked against bytes computed here, from
the model's parameter shapes, independently of meshzero's layout code."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import torch

from meshzero.demo.gpt import GPT, GPTConfig
from tests.distributed import REPO_ROOT

LOSS_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)", re.MULTILINE)
# world rank 16*psi/N +padding +Adam-steps =padded-exact measured measured/N=1
SCALING_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)$",
                         re.MULTILINE)
ALIGN = 4  # elements: shards are padded to a multiple of this


def run_demo(tmp_path, *args: str) -> str:
    paths = [str(REPO_ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    env = {**os.environ, "PYTHONPATH": ":".join(paths)}
    proc = subprocess.run(
        [sys.executable, "-m", "meshzero.cli", "demo", "--out", str(tmp_path / "out"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_demo_trains_and_reports(tmp_path) -> None:
    out = run_demo(tmp_path, "--nproc", "2", "--steps", "5")
    steps = [(int(s), float(loss)) for s, loss in LOSS_LINE.findall(out)]
    assert [s for s, _ in steps] == [0, 1, 2, 3, 4], out
    losses = [loss for _, loss in steps]
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses}"
    assert "meshzero profile of step 2" in out  # the middle step
    assert "memory per rank at rest" in out
    table = out[out.index("memory per rank at rest"):]
    assert re.search(r"^\s+0\s", table, re.MULTILINE) and re.search(r"^\s+1\s", table,
                                                                     re.MULTILINE)
    assert "sample (temperature" in out
    assert f"wrote the profile to {tmp_path / 'out' / 'profile.json'}" in out
    profile = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert profile["world_size"] == 2 and profile["zero_stage"] == 3


def expected_model_state_bytes(world: int, rank: int) -> int:
    """fp32 AdamW at stage 3, every parameter sharded: per flat group (the root's own
    parameters, and each block's), 4 B param + 4 B grad per element of the padded shard,
    Adam m and v (8 B) per real element in it and a 4-byte Adam step per parameter piece."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    root = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    groups = [root] + [list(block.parameters()) for block in model.blocks]
    total = 0
    for params in groups:
        numel = sum(p.numel() for p in params)
        shard = math.ceil(math.ceil(numel / world) / ALIGN) * ALIGN
        lo, hi = rank * shard, (rank + 1) * shard
        real = pieces = offset = 0
        for p in params:
            inside = min(hi, offset + p.numel()) - max(lo, offset)
            if inside > 0:
                real, pieces = real + inside, pieces + 1
            offset += p.numel()
        total += 8 * shard + 8 * real + 4 * pieces
    return total


def test_scaling_halves_model_state_bytes_per_rank(tmp_path) -> None:
    out = run_demo(tmp_path, "--scaling", "--world-sizes", "1", "2", "--steps", "1")
    rows = {(int(r[0]), int(r[1])): [int(x) for x in r[2:7]] for r in SCALING_ROW.findall(out)}
    assert set(rows) == {(1, 0), (2, 0), (2, 1)}, out
    with torch.device("meta"):
        psi = GPT(GPTConfig()).num_params()
    for (world, rank), (formula, padding, steps, exact, measured) in rows.items():
        assert formula == round(16 * psi / world)
        assert formula + padding + steps == exact
        assert exact == expected_model_state_bytes(world, rank), (world, rank)
        assert measured == exact, (world, rank)
    # halving: what two ranks hold apart from Adam's per-tensor step counts is what one
    # rank held, plus the padding
    full = rows[(1, 0)]
    halves = [rows[(2, r)] for r in (0, 1)]
    assert sum(h[4] - h[2] - h[1] for h in halves) == full[4] - full[2] - full[1]
    assert all(abs(h[4] / full[4] - 0.5) < 1e-4 for h in halves)

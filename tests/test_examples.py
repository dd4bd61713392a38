"""The examples run as a user runs them, in fresh processes: alone and under torchrun."""

from __future__ import annotations

import math
import os
import re
import socket
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


def _run_example(script: str, *args: str, ranks: int = 2, timeout: int = 300) -> str:
    """Under torchrun at ``ranks`` ranks, or (ranks=1) one process with the launcher's
    environment set by hand, as `deepspeed --num_gpus 1` would."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = str(REPO_ROOT / "examples" / script)
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, path, *args]
    else:
        cmd = [*TORCHRUN, "--nproc-per-node", str(ranks), path, *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CHAT_STEP = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)\s+kl\s+(\S+)$", re.MULTILINE)


def test_deepspeed_chat_style_example(tmp_path) -> None:
    """Actor + frozen ZeRO-3 reference on 2 ranks: the value head rank 0 writes under
    GatheredParameters(modifier_rank=0) is what every rank holds, in both engines; the KL
    starts at 0 (same weights) and grows; the reference never changes; the ZeRO-3 save
    gathers full tensors."""
    import torch

    out = _run_example("deepspeed_chat_style.py", "--output_dir", str(tmp_path), "--steps", "6",
                       ranks=2)
    torch.manual_seed(7)  # init_value_head's draw on rank 0
    want = float(torch.empty(1, 32).normal_(mean=0.0, std=1 / 33).norm())
    # (the ranks' lines may interleave on the shared pipe: no anchors)
    heads = [float(n) for n in re.findall(r"value head on rank \d: norm (\d+\.\d{8})", out)]
    assert len(heads) == 4 and all(abs(h - want) < 1e-6 for h in heads), (heads, want)
    steps = [(float(loss), float(kl)) for _, loss, kl in CHAT_STEP.findall(out)]
    assert len(steps) == 6, out
    assert abs(steps[0][1]) < 1e-6 and steps[-1][1] > 1e-4, steps
    assert "reference unchanged True" in out, out
    state = torch.load(tmp_path / "actor" / "pytorch_model.bin", weights_only=True)
    assert state["lm_head.weight"].shape == (32, 32) and state["v_head.weight"].shape == (1, 32)
    assert state["embed.weight"].shape == (32, 32)


MEGATRON_ITER = re.compile(r"^iteration\s+(\d+) \| lm loss (\S+) \|", re.MULTILINE)


def _iterations(out: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in MEGATRON_ITER.findall(out)}


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_megatron_style_example_resumes_exactly(tmp_path, ranks) -> None:
    """Saved at iteration 3 with Megatron's client state (args, RNG states); the resumed
    run's iterations 4-6 are the uninterrupted run's."""
    save = str(tmp_path / "gpt")
    first = _run_example("megatron_style.py", "--train-iters", "6", "--save", save,
                         "--save-interval", "3", "--checkpoint-activations", ranks=ranks)
    full = _iterations(first)
    assert sorted(full) == [1, 2, 3, 4, 5, 6], first
    assert all(math.isfinite(v) and v > 0 for v in full.values()), full
    resumed = _run_example("megatron_style.py", "--train-iters", "6", "--load", save,
                           "--load-tag", "iter_0000003", "--checkpoint-activations",
                           ranks=ranks)
    again = _iterations(resumed)
    assert sorted(again) == [4, 5, 6], resumed
    for i in (4, 5, 6):
        assert abs(again[i] - full[i]) <= 1e-5 * abs(full[i]), (i, again[i], full[i])

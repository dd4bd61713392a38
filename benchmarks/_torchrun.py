"""Run a benchmark script's ``--worker`` mode on N local ranks under torchrun (gloo on CPU,
one thread per rank) and read back the one ``RESULT {json}`` line rank 0 prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_ranks(script: str, nproc: int, args: list[str], env: dict | None = None) -> dict:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc script --worker
    *args``; exits with both outputs if the ranks fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, "--worker", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    except subprocess.CalledProcessError as exc:
        sys.exit(f"{' '.join(cmd)} failed:\n{exc.stdout}\n{exc.stderr}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def print_result(result: dict) -> None:
    """What a worker's rank 0 prints for :func:`run_ranks`."""
    print("RESULT " + json.dumps(result), flush=True)

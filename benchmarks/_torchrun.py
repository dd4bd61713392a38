"""Run a benchmark script's ``--worker`` mode on N local ranks under torchrun (gloo on CPU,
one thread per rank) and read back the one ``RESULT {json}`` line rank 0 prints."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable


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


def alternating_args(doc: str, steps: int, aa_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark that alternates arms step by step on 2 ranks: ``--stage``,
    ``--steps``, ``--aa`` (the same arm throughout: the ratio's own noise) and the hidden
    ``--worker`` of :func:`run_ranks`; the caller adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--aa", action="store_true", help=aa_help)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_and_run(parser: argparse.ArgumentParser, script: str,
                  worker: Callable[[argparse.Namespace], None],
                  ) -> tuple[argparse.Namespace, dict | None]:
    """The options; in ``--worker`` mode (a rank under torchrun) run ``worker`` and return no
    result, else launch ``script`` on 2 ranks (:func:`run_ranks`) and return its result."""
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return args, None
    return args, run_ranks(script, 2, sys.argv[1:])

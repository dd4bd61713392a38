"""meshzero vs PyTorch FSDP2 vs DeepSpeed, side by side: same model, data, steps, world size
and threads per rank, one system after another, each under torchrun (gloo on CPU).

    python benchmarks/compare.py                                  # GPT ~84 M, W=2, ZeRO-2 and 3
    python benchmarks/compare.py --model mlp                      # issue 6's 16.8 M MLP baseline
    python benchmarks/compare.py --nproc 4 --stages 3 --bf16 --write-results
    python benchmarks/compare.py --systems meshzero,fsdp2 --tiny --steps 2 --warmup 1   # CI

Flags: --model gpt|mlp, --hidden --layers --heads --vocab --seq --batch (per rank) override the
model; --tiny shrinks it to a few hundred K parameters; --nproc ranks; --threads
OMP_NUM_THREADS per rank (default 1); --steps timed steps after --warmup; --stages 2 3;
--offload none|cpu|both; --bf16 (bf16 compute, fp32 master and fp32 gradient reduction in
every system); --systems meshzero,fsdp2,deepspeed; --repeat R runs everything R times in
alternating order and keeps each row's fastest run; --wait-idle S waits up to S seconds before
each run for other processes to go quiet (the "other load" column is the share of the
machine's CPU time that processes other than the benchmark used during the run: on a shared
2-core machine a busy neighbour changes every time); --write-results appends the table, the
command and the machine to benchmarks/RESULTS.md; --profile PREFIX writes a cProfile of rank
0's timed steps per system and stage (read it with ``python -m pstats``).

What each column is, per system and stage (AdamW, fused on CPU, in every system):

- step s: the median over the timed steps of the slowest rank's wall time of one step
  (forward, backward, optimizer step, zeroing the gradients).
- model states/rank: bytes of parameters, fp32 master, gradients and optimizer states that rank
  0 holds. meshzero: the sum of ``memory_report()``'s categories. FSDP2: the local shards of
  the DTensor parameters, gradients and optimizer states, taken after backward. DeepSpeed: its
  flat partitions (ZeRO-2: full 16-bit flat params, fp32 master partition, reduced gradient
  partitions; ZeRO-3: param partitions + persistent params, fp32 master, gradient partition
  buffer) plus the optimizer's state, storages counted once, taken after backward.
- peak RSS/rank: ``ru_maxrss``, the maximum over ranks (interpreter and torch included).
- comm/step/rank: bytes one rank sends per step under ring algorithms (all-gather and
  reduce-scatter B (N-1)/N, all-reduce 2B (N-1)/N, as meshzero's comm_report counts).
  meshzero: its ``comm_report()`` of the last timed step. FSDP2 and DeepSpeed: measured by
  a TorchDispatchMode that sees every c10d collective of one extra, untimed step (the same
  counter checks meshzero's own figure; a mismatch is printed under the table).
- exposed comm s: meshzero only, the median time per step the caller was blocked in waits.
- no-comm limit: the same per-rank work (one rank's batch) in one process with the same
  threads, no sharding and a plain ``torch.optim.AdamW(fused=True)`` (``torch.autocast`` to
  bf16 with --bf16). With more ranks than cores the ranks share cores and the limit is not a
  fair floor; the table says so.

DeepSpeed runs only where ``import deepspeed`` works (it is not a dependency of meshzero).
Offload rows (--offload cpu or both) pass ``"offload_optimizer": {"device": "cpu"}`` (and at
ZeRO-3 ``"offload_param": {"device": "cpu"}``) to meshzero and DeepSpeed (DeepSpeedCPUAdam),
and ``CPUOffloadPolicy`` to FSDP2, compared with meshzero's offload row of the same stage. A
system that cannot set up its offload here (FSDP2 is tried first in a one-process probe; the
others when they build their engine) gets a row with the exception's first line ("failed" for
meshzero, "unsupported here" for the others) instead of numbers; such rows do not fail the run.

The code: this file is the command line and the order of runs; ``_systems.py`` what runs in a
rank (a runner per system, the timed loop), ``_launch.py`` how a run is started and probed,
``_table.py`` the table and RESULTS.md, ``_models.py`` the models and data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _launch import deepspeed_note, fsdp2_offload_note, launch, wait_for_idle
from _systems import worker
from _table import render, write_results

SYSTEMS = ("meshzero", "fsdp2", "deepspeed")


def _plan(args) -> tuple[list[dict], list[tuple[dict, dict, int | None]]]:
    """Rows of the table, and the (row, job, nproc) runs that fill them."""
    base = {"model": args.model, "tiny": args.tiny, "sizes": args.sizes, "seed": args.seed,
            "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
            "bf16": args.bf16, "profile": args.profile and os.path.abspath(args.profile)}
    notes = {"deepspeed": deepspeed_note() if "deepspeed" in args.systems else None}
    offloads = {"none": [False], "cpu": [True], "both": [False, True]}[args.offload]
    if True in offloads and "fsdp2" in args.systems:  # a one-process probe: cheaper than a run
        notes["fsdp2_offload"] = fsdp2_offload_note()
    rows, runs = [], []
    for stage in args.stages:
        for offload in offloads:
            for system in args.systems:
                row = {"system": system, "stage": stage, "offload": offload}
                skip = notes["deepspeed"] if system == "deepspeed" else None
                skip = skip or (notes.get(f"{system}_offload") if offload else None)
                if skip:
                    row["note"] = skip
                else:
                    runs.append((row, dict(base, system=system, stage=stage, offload=offload),
                                 args.nproc))
                rows.append(row)
    nocomm = {"system": "nocomm", "stage": 0, "offload": False}
    rows.append(nocomm)
    runs.append((nocomm, dict(base, system="nocomm", stage=0, offload=False), None))
    if args.nproc > 1 and not args.tiny:  # N independent processes at once: sharing cores
        both = {"system": "nocomm_concurrent", "stage": 0, "offload": False}
        rows.append(both)
        runs.append((both, dict(base, system="nocomm", stage=0, offload=False), args.nproc))
    return rows, runs


def run_all(args) -> tuple[list[dict], dict]:
    """Every run ``--repeat`` times, in alternating order; a row keeps its fastest run."""
    rows, runs = _plan(args)
    for rep in range(args.repeat):
        for row, job, nproc in runs if rep % 2 == 0 else runs[::-1]:
            busy = wait_for_idle(args.wait_idle)
            label = f"{job['system']}{'' if nproc else ' (1 process)'} ZeRO-{job['stage']}"
            print(f"[{rep + 1}/{args.repeat}] {label}{' offload' if job['offload'] else ''} "
                  f"(other load before {busy:.0%}) ...", file=sys.stderr, flush=True)
            result = launch(job, nproc, args.timeout)
            if "error" in result:
                row["error"] = result["error"]  # a failure in any repeat fails the run
            elif "unsupported" in result:  # the system could not set up this offload here
                why = "failed" if job["system"] == "meshzero" else "unsupported here"
                row["note"] = f"{why}: {result['unsupported']}"
            elif "step_s" not in row or result["step_s"] < row["step_s"]:
                row.update(result)
    nocomm = next(r for r in rows if r["system"] == "nocomm")
    both = next((r for r in rows if r["system"] == "nocomm_concurrent"), None)
    if both is not None:
        nocomm["concurrent"] = both
    return [r for r in rows if not r["system"].startswith("nocomm")], nocomm

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    for name in ("hidden", "layers", "heads", "vocab", "seq", "batch"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(2, 3))
    p.add_argument("--offload", choices=("none", "cpu", "both"), default="both")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per system run")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything R times, alternating the order; keep each row's fastest")
    p.add_argument("--wait-idle", type=float,
                   help="seconds to wait before each run for other processes to go quiet "
                        "(default 120, 0 with --tiny)")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--profile", metavar="PREFIX",
                   help="cProfile rank 0's timed steps into PREFIX.<system>.zero<stage>.prof")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq",
                                                "batch")}
    if args.wait_idle is None:
        args.wait_idle = 0 if args.tiny else 120
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    rows, nocomm = run_all(args)
    psi = next((r["psi"] for r in rows + [nocomm] if "psi" in r), None)
    table = render(rows, nocomm, args)
    print(table)
    if args.write_results:
        write_results(table, args, psi)
    # an offload row a system cannot set up here has a note, not an error: it fails nothing
    failed = [r for r in rows if "error" in r] + ([nocomm] if "error" in nocomm else [])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

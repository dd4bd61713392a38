"""The cost of the phase check (faults/phase.py) on the default training path.

    python benchmarks/phase_check.py --stage 2 --steps 200 [--width 2048] [--aa]

Two ranks on gloo train an MLP (4 x Linear(width, width) + GELU, 8 samples per rank); the
steps alternate between the phase check on and off, each started after a barrier, so both
see the same machine load. Off: no post at the backward's entry, and the step's non-finite
check sums over the data group by its own all-reduce, as before the check existed; stage
3's unit-order check runs in both. Prints rank 0's median step time of each, their ratio,
and the check's ops per step (phase_check: the check's own posts; step_check: the
non-finite check's sum, on: a phase exchange over the check's group carrying the step's
phase, off: an all-reduce over the data group; order_check: stage 3's unit-order check,
none at width 256, whose layers stay resident under the persistence threshold). ``--aa``:
off in both halves, the ratio's own noise on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _control_ops(engine) -> Counter:
    """Counts of the check's ops in the last step (the engine counts per step; the step's
    sum is counted as step_check whichever group it goes over)."""
    report = engine.comm_stats.by_op()
    return Counter({op: report.get(op, {}).get("count", 0)
                    for op in ("phase_check", "step_check", "order_check")})


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    import meshzero
    from meshzero.faults.phase import PhaseCheck

    on = [True]
    enter = PhaseCheck.enter

    def enter_when_on(self, phase: str, post: bool = True) -> None:
        enter(self, phase, post and on[0])

    PhaseCheck.enter = enter_when_on  # type: ignore[method-assign]
    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(4)])
    cfg = {"train_batch_size": 8 * world, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    phases = engine.guard.phases
    x = torch.randn(8, width)
    times: dict[bool, list[float]] = {True: [], False: []}
    ops: Counter = Counter()  # (on, op) -> count of the check's ops
    for i in range(args.steps):
        on[0] = i % 2 == 0 and not args.aa
        engine.guard.phases = phases if on[0] else None  # off: the sum by all-reduce
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        times[i % 2 == 0].append(time.perf_counter() - t0)
        ops.update({(i % 2 == 0, op): n for op, n in _control_ops(engine).items()})
    if rank == 0:
        out.put(({k: statistics.median(v[5:]) for k, v in times.items()},
                 {f"{'on' if k[0] else 'off'}: {k[1]}": n / len(times[k[0]])
                  for k, n in sorted(ops.items(), reverse=True) if n}))
    engine.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--aa", action="store_true",
                        help="the check off in both halves: the ratio's noise on this machine")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 2, f"{tmp}/store", args, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        res, exchanges = out.get(timeout=1200)
        for p in procs:
            p.join()
    first = "off (A/A: even steps)" if args.aa else "with the phase check"
    print(f"stage {args.stage}, W=2, width {args.width}: median step {res[True] * 1e3:.3f} ms "
          f"{first}, {res[False] * 1e3:.3f} ms without, ratio {res[True] / res[False]:.3f}")
    print("ops per step: " + ", ".join(f"{k} {v:g}" for k, v in exchanges.items()))


if __name__ == "__main__":
    main()

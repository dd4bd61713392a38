"""The cost of the phase check (faults/phase.py, faults/stall.py) on the default training
path.

    python benchmarks/phase_check.py --stage 2 --steps 300 [--width 256] [--aa]

Two ranks on gloo train an MLP (4 x Linear(width, width) + GELU, 8 samples per rank); the
steps cycle through three arms, each step started after a barrier, so all see the same
machine load:

- ``watch``: as the engine runs by default on gloo: every wait on a collective is made in
  slices (the stall watch) and nothing is posted ahead;
- ``posts``: the check as on another backend (NCCL): the backward posts its phase ahead on
  the check's group and the step's non-finite sum is a phase exchange there;
- ``none``: no check at all (waits in one piece, no posts, the sum by the data group's
  all-reduce).

Prints rank 0's median step time of each arm, ``watch`` and ``posts`` over ``none``, and
the check's ops per step (phase_check: posts; step_check: the non-finite check's sum;
order_check: stage 3's unit-order check, none at width 256, whose layers stay resident
under the persistence threshold). ``--aa``: ``none`` in every arm, the ratios' own noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from _torchrun import alternating_args, parse_and_run, print_result
from torch import nn

import meshzero
from meshzero.faults.phase import PhaseCheck


def _control_ops(engine) -> Counter:
    """Counts of the check's ops in the last step (the engine counts per step; the step's
    sum is counted as step_check whichever group it goes over)."""
    report = engine.comm_stats.by_op()
    return Counter({op: report.get(op, {}).get("count", 0)
                    for op in ("phase_check", "step_check", "order_check")})


ARMS = ("watch", "posts", "none")


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    arm = ["watch"]
    enter = PhaseCheck.enter

    def enter_unless_none(self, phase: str, post: bool = True) -> None:
        enter(self, phase, post and arm[0] != "none")

    PhaseCheck.enter = enter_unless_none  # type: ignore[method-assign]
    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(4)])
    cfg = {"train_batch_size": 8 * world, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 10 ** 9}  # no log line on some steps only
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    phases = engine.guard.phases
    watch = phases.watch
    assert watch is not None, "gloo: the engine watches its waits"
    x = torch.randn(8, width)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    ops: Counter = Counter()  # (arm, op) -> count of the check's ops
    for i in range(args.steps):
        name = ARMS[i % len(ARMS)]
        arm[0] = "none" if args.aa else name
        # watch: slices and no posts; posts: no watch, so posts ahead; none: neither
        phases.watch = phases.stats.watch = watch if arm[0] == "watch" else None
        engine.guard.phases = None if arm[0] == "none" else phases
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        times[name].append(time.perf_counter() - t0)
        ops.update({(name, op): n for op, n in _control_ops(engine).items()})
    phases.watch = phases.stats.watch = watch
    engine.close()
    if dist.get_rank() == 0:
        print_result({"median": {k: statistics.median(v[5:]) for k, v in times.items()},
                      "ops": {f"{k[0]}: {k[1]}": n / len(times[k[0]])
                              for k, n in sorted(ops.items()) if n}})
    dist.destroy_process_group()


def main() -> None:
    parser = alternating_args(__doc__, 300, "no check in every arm: the ratios' noise on this "
                              "machine")
    parser.add_argument("--width", type=int, default=256)
    args, out = parse_and_run(parser, __file__, worker)
    if out is None:  # a rank
        return
    res, exchanges = out["median"], out["ops"]
    base = res["none"]
    aa = " (A/A: none in every arm)" if args.aa else ""
    print(f"stage {args.stage}, W=2, width {args.width}{aa}: median step "
          + ", ".join(f"{a} {res[a] * 1e3:.3f} ms" for a in ARMS)
          + f"; watch/none {res['watch'] / base:.3f}, posts/none {res['posts'] / base:.3f}")
    print("ops per step: " + ", ".join(f"{k} {v:g}" for k, v in exchanges.items()))


if __name__ == "__main__":
    main()

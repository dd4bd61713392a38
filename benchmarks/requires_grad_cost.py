"""The cost of following requires_grad (zero/trainability.py) when nothing is toggled.

    python benchmarks/requires_grad_cost.py --stage 2 --steps 200 [--blocks 24] [--aa]

Before each backward the engine reads ``requires_grad`` of every parameter (what the step
skips, which frozen groups become trainable) and the step asks, per fragment, whether it is
skipped. Two ranks on gloo train ``--blocks`` pre-LN MLP blocks (LayerNorm, Linear(256,
1024), GELU, Linear(1024, 256): 6 parameters each) with AdamW; the steps alternate between
the real tracking and a stand-in that returns at once what the tracking returns for an
untouched model (nothing frozen, nothing skipped), each step started after a barrier, so
both halves see the same machine load. Prints rank 0's median step time of each, their
ratio, and the tracking's own time per step (``_track_requires_grad``, timed in the "on"
steps). ``--aa``: the stand-in in both halves, the ratio's own noise on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import alternating_args, parse_and_run, print_result
from torch import nn

import meshzero
from meshzero.zero.state import ZeroModelState
from meshzero.zero.trainability import Trainability


def _untouched(self: Trainability) -> bool:
    """What before_backward returns, and leaves, when no requires_grad was changed."""
    opened = not self.window_open
    self.window_open = True
    return opened


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    real_before, real_track = Trainability.before_backward, ZeroModelState._track_requires_grad
    on, tracked = [True], []

    def before(self: Trainability) -> bool:
        return real_before(self) if on[0] else _untouched(self)

    def track(self: ZeroModelState) -> None:
        t0 = time.perf_counter()
        real_track(self)
        if on[0]:
            tracked.append(time.perf_counter() - t0)

    Trainability.before_backward = before  # type: ignore[method-assign]
    ZeroModelState._track_requires_grad = track  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(),
                                          nn.Linear(1024, 256)) for _ in range(args.blocks)])
    cfg = {"train_batch_size": 4 * world, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    x = torch.randn(4, 256)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.steps):
        on[0] = i % 2 == 0 and not args.aa
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        times[i % 2 == 0].append(time.perf_counter() - t0)
    params = sum(1 for _ in engine.module.parameters())
    engine.close()
    if dist.get_rank() == 0:
        print_result({"on": statistics.median(times[True][5:]),
                      "off": statistics.median(times[False][5:]),
                      "tracked": statistics.median(tracked[5:]) if tracked else 0.0,
                      "params": params})
    dist.destroy_process_group()


def main() -> None:
    parser = alternating_args(__doc__, 200, "the stand-in in both halves: the ratio's noise "
                              "on this machine")
    parser.add_argument("--blocks", type=int, default=24)
    args, res = parse_and_run(parser, __file__, worker)
    if res is None:  # a rank
        return
    first = "stand-in (A/A: even steps)" if args.aa else "tracking"
    print(f"stage {args.stage}, W=2, {args.blocks} blocks ({res['params']} parameters): median "
          f"step {res['on'] * 1e3:.3f} ms with the {first}, {res['off'] * 1e3:.3f} ms with the "
          f"stand-in, ratio {res['on'] / res['off']:.3f}; the tracking itself "
          f"{res['tracked'] * 1e6:.0f} us per step")


if __name__ == "__main__":
    main()

"""The cost of the phase check (faults/phase.py) on the default training path.

    python benchmarks/phase_check.py --stage 2 --steps 200

Two ranks on gloo train a small MLP (4 x Linear(256, 256) + GELU, 8 samples per rank); the
steps alternate between the phase check on and off (its posts before the backward's
reductions and the step, patched out on the odd steps; stage 3's unit-order check runs in
both), each started after a barrier, so both see the same machine load. Prints rank 0's
median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _rank(rank: int, world: int, store: str, stage: int, steps: int, out) -> None:
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
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    cfg = {"train_batch_size": 8 * world, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    x = torch.randn(8, 256)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps):
        on[0] = i % 2 == 0
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        times[on[0]].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({k: statistics.median(v[5:]) for k, v in times.items()})
    engine.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 2, f"{tmp}/store", args.stage, args.steps,
                                                 out)) for r in range(2)]
        for p in procs:
            p.start()
        res = out.get(timeout=600)
        for p in procs:
            p.join()
    print(f"stage {args.stage}, W=2: median step {res[True] * 1e3:.3f} ms with the phase "
          f"check, {res[False] * 1e3:.3f} ms without, ratio {res[True] / res[False]:.3f}")


if __name__ == "__main__":
    main()

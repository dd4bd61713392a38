"""gloo on CPU: its own all-gather and reduce-scatter against the ways meshzero's Communicator
does them (comm/communicator.py), at the sizes of the benchmark models' flat groups.

    python benchmarks/gloo_collectives.py                     # W=2, shards of 3.5 M and 19.3 M
    python benchmarks/gloo_collectives.py --nproc 4 --numel 1000000

For each shard size S (fp32 elements per rank) the median wall time over --repeat calls, each
started after a barrier, the slowest rank's:

- gloo all_gather: ``all_gather_into_tensor`` (gloo receives into a fresh N*S buffer, then
  copies it into the output).
- Communicator.all_gather: meshzero's point-to-point sends and receives into the output.
- gloo reduce_scatter: ``reduce_scatter_tensor`` (gloo clones the N*S input on the calling
  thread and all-reduces the clone).
- Communicator.reduce_scatter: meshzero's all-to-all into a workspace and a local sum.

3.5 M and 19.3 M are the shards at W=2 of one 7.1 M-parameter GPT block and of the 38.6 M
tied embedding of benchmarks/_models.py's GPT.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import print_result, run_ranks


def _timed(fn, repeat: int) -> float:
    times = []
    for i in range(repeat + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= 2:  # two warm-up calls
            times.append(dt.item())
    return statistics.median(times)


def _row(comm, numel: int, n: int, repeat: int) -> dict:
    shard, out = torch.randn(numel), torch.empty(n * numel)
    full, work = torch.randn(n * numel), torch.empty(n * numel)
    return {
        "numel": numel,
        "gloo all_gather": _timed(lambda: dist.all_gather_into_tensor(out, shard), repeat),
        "Communicator.all_gather": _timed(lambda: comm.all_gather(out, shard).wait(), repeat),
        "gloo reduce_scatter": _timed(lambda: dist.reduce_scatter_tensor(shard, full), repeat),
        "Communicator.reduce_scatter": _timed(
            lambda: comm.reduce_scatter(shard, full, work).wait(), repeat)}


def worker(numels: list[int], repeat: int) -> None:
    from meshzero.comm import CommStats, Communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = Communicator(dist.group.WORLD, "dp", CommStats())
    rows = [_row(comm, numel, n, repeat) for numel in numels]
    if rank == 0:
        print_result({"world": n, "rows": rows})
    # nothing may hold the destroyed group into interpreter exit (docs/lifecycle.md)
    comm.drop_groups()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--numel", type=int, nargs="+", default=[3_500_000, 19_300_000])
    p.add_argument("--repeat", type=int, default=12)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.numel, args.repeat)
        return
    res = run_ranks(__file__, args.nproc, ["--numel", *map(str, args.numel),
                                           "--repeat", str(args.repeat)])
    cols = ["gloo all_gather", "Communicator.all_gather", "gloo reduce_scatter",
            "Communicator.reduce_scatter"]
    print(f"W={res['world']}, fp32, median ms of {args.repeat} calls (slowest rank)\n")
    print("| shard elements | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for row in res["rows"]:
        print(f"| {row['numel']:,} | " + " | ".join(f"{row[c] * 1e3:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()

"""On gloo over CPU, Communicator.reduce_scatter goes by an all-to-all and a local sum (gloo's
own reduce-scatter all-reduces a copy of the input made on the calling thread), and
Communicator.all_gather by point-to-point sends and receives into the output (gloo's own
receives into a fresh buffer and copies it out): the same results as gloo's collectives,
the same counts and bytes, and the input left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshzero.comm import CommStats, Communicator
from tests.distributed import run_distributed

SHARD = 6


def _reduce(rank: int, world: int, async_ops: bool) -> dict:
    # integer-valued floats: every summation order gives the same bits
    full = torch.arange(world * SHARD, dtype=torch.float32) * (rank + 1)
    before = full.clone()
    gloo_shard = torch.empty(SHARD)
    dist.reduce_scatter_tensor(gloo_shard, full.clone())
    out: dict = {"gloo": gloo_shard}
    for name, workspace in (("fresh", None), ("given", torch.full_like(full, 7.0))):
        stats = CommStats()
        comm = Communicator(dist.group.WORLD, "dp", stats, async_ops=async_ops)
        shard = torch.full((SHARD,), -1.0)
        comm.reduce_scatter(shard, full, workspace).wait()
        op = stats.by_op()["reduce_scatter"]
        out[name] = {"shard": shard, "count": op["count"], "bytes": op["bytes"],
                     "pending": len(stats.pending), "by_all_to_all":
                     comm.reduces_by_all_to_all(full)}
    out["untouched"] = torch.equal(full, before)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_ops", [True, False])
def test_reduce_scatter_by_all_to_all_matches_gloo(tmp_path, world_size, async_ops):
    results = run_distributed(_reduce, world_size, tmp_path, async_ops)
    ranks_sum = sum(range(1, world_size + 1))
    for rank, res in enumerate(results):
        want = torch.arange(rank * SHARD, (rank + 1) * SHARD, dtype=torch.float32) * ranks_sum
        assert torch.equal(res["gloo"], want)
        for name in ("fresh", "given"):
            got = res[name]
            assert got["by_all_to_all"]
            assert torch.equal(got["shard"], want), (rank, name)
            assert (got["count"], got["pending"]) == (1, 0)
            assert got["bytes"] == world_size * SHARD * 4 * (world_size - 1) // world_size
        assert res["untouched"]


def _gather(rank: int, world: int, async_ops: bool) -> dict:
    stats = CommStats()
    comm = Communicator(dist.group.WORLD, "dp", stats, async_ops=async_ops)
    out: dict = {}
    # several gathers of different sizes in flight at once, waited on out of order
    sizes = (SHARD, 3, 1000)
    outputs = [torch.full((world * n,), -1.0) for n in sizes]
    shards = [torch.arange(n, dtype=torch.float32) + 1000 * rank for n in sizes]
    handles = [comm.all_gather(o, s) for o, s in zip(outputs, shards, strict=True)]
    for h in reversed(handles):
        h.wait()
    out["outputs"] = outputs
    gloo = [torch.empty(world * n) for n in sizes]
    for g, s in zip(gloo, shards, strict=True):
        dist.all_gather_into_tensor(g, s)
    out["gloo"] = gloo
    # in place: this rank's slice of the output is the shard (stages 1-2)
    full = torch.full((world * SHARD,), float(rank))
    comm.all_gather(full, full[rank * SHARD:(rank + 1) * SHARD]).wait()
    out["in_place"] = full
    op = stats.by_op()["all_gather"]
    out["count"], out["bytes"], out["pending"] = op["count"], op["bytes"], len(stats.pending)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_ops", [True, False])
def test_all_gather_point_to_point_matches_gloo(tmp_path, world_size, async_ops):
    results = run_distributed(_gather, world_size, tmp_path, async_ops)
    sizes = (SHARD, 3, 1000)
    for res in results:
        for n, got, gloo in zip(sizes, res["outputs"], res["gloo"], strict=True):
            want = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r
                              for r in range(world_size)])
            assert torch.equal(got, want) and torch.equal(gloo, want)
        assert torch.equal(res["in_place"], torch.arange(world_size).float()
                           .repeat_interleave(SHARD))
        assert (res["count"], res["pending"]) == (4, 0)
        assert res["bytes"] == sum(world_size * n * 4 * (world_size - 1) // world_size
                                   for n in (*sizes, SHARD))

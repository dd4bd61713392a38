"""Communicator.reduce_scatter on gloo over CPU goes by an all-to-all and a local sum (gloo's
own reduce-scatter all-reduces a copy of the input made on the calling thread): the same
shard as gloo's reduce-scatter, the same counts and bytes, and the input left as it was."""

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

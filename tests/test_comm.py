"""Communicator.reduce_scatter on gloo: the in-place path for a scratch input (an all-reduce
of the caller's own buffer, this rank's slice copied out at the wait) gives the same shard
and the same counts as gloo's reduce-scatter, and leaves a non-scratch input untouched."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshzero.comm import CommStats, Communicator
from tests.distributed import run_distributed

SHARD = 6


def _reduce(rank: int, world: int, async_ops: bool) -> dict:
    out = {}
    for scratch in (False, True):
        stats = CommStats()
        comm = Communicator(dist.group.WORLD, "dp", stats, async_ops=async_ops)
        # integer-valued floats: every summation order gives the same bits
        full = torch.arange(world * SHARD, dtype=torch.float32) * (rank + 1)
        before = full.clone()
        shard = torch.full((SHARD,), -1.0)
        handle = comm.reduce_scatter(shard, full, scratch=scratch)
        handle.wait()
        assert not stats.pending
        op = stats.by_op()["reduce_scatter"]
        out[scratch] = {"shard": shard, "count": op["count"], "bytes": op["bytes"],
                        "untouched": torch.equal(full, before)}
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_ops", [True, False])
def test_scratch_reduce_scatter_matches_gloo(tmp_path, world_size, async_ops):
    results = run_distributed(_reduce, world_size, tmp_path, async_ops)
    ranks_sum = sum(range(1, world_size + 1))
    for rank, res in enumerate(results):
        want = torch.arange(rank * SHARD, (rank + 1) * SHARD, dtype=torch.float32) * ranks_sum
        for scratch in (False, True):
            assert torch.equal(res[scratch]["shard"], want), (rank, scratch)
            assert res[scratch]["count"] == 1
            assert res[scratch]["bytes"] == world_size * SHARD * 4 * (world_size - 1) // world_size
        assert res[False]["untouched"]  # the plain path never writes the caller's input
        assert not res[True]["untouched"]  # the scratch one did run in place

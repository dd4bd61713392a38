"""The spawn helper itself: results in rank order, and every way a rank can fail."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import DistributedTestError, run_distributed

TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def _all_reduce_rank(rank: int, world_size: int, offset: float = 0.0) -> dict:
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "group_rank": dist.get_rank(),
        "group_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": value,
        "threads": torch.get_num_threads(),
        "env": {name: os.environ[name] for name in TORCHRUN_VARS},
    }


def _grad_tensor(rank: int, world_size: int) -> dict:
    weight = torch.nn.Parameter(torch.full((3,), float(rank)))
    return {"doubled": weight * 2, "param": weight}


def _rank_raises(rank: int, world_size: int, bad_rank: int) -> None:
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()  # the others block here until the helper kills them


def _rank1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _rank1_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _unpicklable_result(rank: int, world_size: int):
    return lambda: rank


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(tmp_path, world_size):
    results = run_distributed(_all_reduce_rank, world_size, tmp_path, offset=1.0)
    expected_sum = sum(range(world_size)) + world_size
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, result in enumerate(results):
        assert result["group_rank"] == rank
        assert result["group_size"] == world_size
        assert result["backend"] == "gloo"
        assert result["sum"].item() == expected_sum
        assert result["threads"] == 1
        env = result["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["OMP_NUM_THREADS"] == "1"
    assert len({r["env"]["MASTER_PORT"] for r in results}) == 1


def test_several_calls_in_one_test(run_ranks):
    first = run_ranks(_all_reduce_rank, 2)
    second = run_ranks(_all_reduce_rank, 3, 10.0)
    assert [r["sum"].item() for r in first] == [1.0, 1.0]
    assert [r["sum"].item() for r in second] == [33.0, 33.0, 33.0]


def test_tensors_come_back_detached(tmp_path):
    results = run_distributed(_grad_tensor, 2, tmp_path)
    for rank, result in enumerate(results):
        for tensor in result.values():
            assert tensor.device.type == "cpu"
            assert not tensor.requires_grad and tensor.grad_fn is None
        assert torch.equal(result["doubled"], torch.full((3,), 2.0 * rank))


@pytest.mark.parametrize(("world_size", "bad_rank"), [(2, 1), (4, 2)])
def test_rank_that_raises_is_named_with_traceback(tmp_path, world_size, bad_rank):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_raises, world_size, tmp_path, bad_rank, timeout=60.0)
    message = str(info.value)
    assert message.startswith(f"rank {bad_rank} raised:")
    assert "Traceback (most recent call last)" in message
    assert "_rank_raises" in message
    assert f"ValueError: boom from rank {bad_rank}" in message
    assert time.monotonic() - start < 15.0  # the blocked ranks were killed, not awaited


def test_rank_that_hangs_is_named_after_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_hangs, 2, tmp_path, timeout=5.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.splitlines()[0] == "rank 1 did not finish within 5.0 s"
    assert "rank 0" not in message.splitlines()[0]
    assert "_rank1_hangs" in message  # the hung rank's Python stack is included
    assert 5.0 <= elapsed < 15.0


def test_rank_that_exits_is_reported_with_exit_code(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_exits, 2, tmp_path, timeout=60.0)
    assert str(info.value).startswith("rank 1 exited with code 3 without reporting")


def test_unpicklable_result_is_an_error_of_that_rank(tmp_path):
    with pytest.raises(DistributedTestError, match=r"rank 0 raised:(.|\n)*pickle"):
        run_distributed(_unpicklable_result, 1, tmp_path)


def test_unpicklable_fn_fails_fast(tmp_path):
    with pytest.raises(TypeError, match="define fn at module level"):
        run_distributed(lambda rank, world_size: rank, 2, tmp_path)


def _block_stores(monkeypatch, tmp_path, attempts: int) -> None:
    """Make the next `attempts` spawns fail to join: their store path is a directory."""
    from tests import distributed

    monkeypatch.setattr(distributed, "_call_ids", itertools.count(1000))
    for call_id in range(1000, 1000 + attempts):
        (tmp_path / f"store_{os.getpid()}_{call_id}").mkdir()


def test_group_start_failure_is_retried_on_a_fresh_store(tmp_path, monkeypatch):
    _block_stores(monkeypatch, tmp_path, attempts=1)
    results = run_distributed(_all_reduce_rank, 2, tmp_path, timeout=60.0)
    assert [r["sum"].item() for r in results] == [1.0, 1.0]


def test_group_start_failure_that_persists_is_reported(tmp_path, monkeypatch):
    from tests.distributed import GROUP_START_ATTEMPTS

    _block_stores(monkeypatch, tmp_path, attempts=GROUP_START_ATTEMPTS)
    with pytest.raises(DistributedTestError, match="rank 0 could not join the group"):
        run_distributed(_all_reduce_rank, 2, tmp_path, timeout=60.0)


def test_failure_inside_fn_is_not_retried(tmp_path, monkeypatch):
    from tests import distributed

    spawns = []
    real_spawn = distributed._spawn
    monkeypatch.setattr(distributed, "_spawn", lambda *a: spawns.append(1) or real_spawn(*a))
    with pytest.raises(DistributedTestError, match="rank 1 raised"):
        run_distributed(_rank_raises, 2, tmp_path, 1, timeout=60.0)
    assert len(spawns) == 1

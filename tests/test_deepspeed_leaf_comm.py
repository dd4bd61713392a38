"""``meshzero.deepspeed.comm``: DeepSpeed's collectives (deepspeed/comm/comm.py: all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, broadcast, reduce, gather, scatter,
all_to_all_single, send/recv, ...) give what torch.distributed gives, and each one a user
issues is counted in the live engine's ``comm_report()`` (DeepSpeed's comms logger counts
every deepspeed.comm op: its ``timed_op`` wrapper), at world sizes 1, 2 and 4 on gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import meshzero
import meshzero.deepspeed.comm as ds_dist
from meshzero.comm import ring_bytes
from meshzero.comm.bare import all_gather_single, reduce_scatter_single
from tests.distributed import run_distributed
from tests.models import build_model, loss_fn_for, make_batches, split_for_rank

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}


def _values(rank: int, n: int = 8) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank


def _same_as_torch(rank: int, world: int) -> None:
    """Each collective against torch.distributed's on the same inputs."""
    x, ref = _values(rank), _values(rank)
    ds_dist.all_reduce(x)
    dist.all_reduce(ref)
    assert torch.equal(x, ref)
    x, ref = _values(rank), _values(rank)
    ds_dist.all_reduce(x, op=ds_dist.ReduceOp.MAX)
    dist.all_reduce(ref, op=dist.ReduceOp.MAX)
    assert torch.equal(x, ref)
    out, ref = torch.empty(8 * world), torch.empty(8 * world)
    ds_dist.all_gather_into_tensor(out, _values(rank))
    all_gather_single(ref, _values(rank))
    assert torch.equal(out, ref)
    out = torch.empty(8 * world)
    ds_dist.allgather_fn(out, _values(rank))
    assert torch.equal(out, ref)
    shard, ref_shard = torch.empty(2), torch.empty(2)
    ds_dist.reduce_scatter_fn(shard, _values(rank, 2 * world))
    reduce_scatter_single(ref_shard, _values(rank, 2 * world))
    assert torch.equal(shard, ref_shard)
    parts = [torch.empty(8) for _ in range(world)]
    ds_dist.all_gather(parts, _values(rank))
    assert torch.equal(torch.cat(parts), ref)
    b = _values(rank)
    ds_dist.broadcast(b, src=world - 1)
    assert torch.equal(b, _values(world - 1))
    r = _values(rank)
    ds_dist.reduce(r, dst=0)
    if rank == 0:
        assert torch.equal(r, sum(_values(k) for k in range(world)))
    got = [torch.empty(8) for _ in range(world)] if rank == 0 else None
    ds_dist.gather(_values(rank), got, dst=0)
    if rank == 0:
        assert torch.equal(torch.cat(got), ref)
    s = torch.empty(8)
    ds_dist.scatter(s, [_values(k) for k in range(world)] if rank == 0 else None, src=0)
    assert torch.equal(s, _values(rank))
    a2a, ref_a2a = torch.empty(2 * world), torch.empty(2 * world)
    ds_dist.all_to_all_single(a2a, _values(rank, 2 * world))
    dist.all_to_all_single(ref_a2a, _values(rank, 2 * world))
    assert torch.equal(a2a, ref_a2a)
    assert ds_dist.get_rank() == rank and ds_dist.get_world_size() == world
    assert ds_dist.get_global_rank(ds_dist.get_world_group(), rank) == rank
    assert ds_dist.is_initialized() and ds_dist.get_backend() == "gloo"
    ds_dist.barrier()


def _ring_send(rank: int, world: int) -> None:
    """send/recv and isend/irecv around the ring (two ranks or more)."""
    if world < 2:
        return
    got = torch.empty(8)
    if rank % 2 == 0:
        ds_dist.send(_values(rank), dst=(rank + 1) % world)
        ds_dist.recv(got, src=(rank - 1) % world)
    else:
        ds_dist.recv(got, src=(rank - 1) % world)
        ds_dist.send(_values(rank), dst=(rank + 1) % world)
    assert torch.equal(got, _values((rank - 1) % world))
    works = [ds_dist.isend(_values(rank), dst=(rank + 1) % world),
             ds_dist.irecv(got, src=(rank - 1) % world)]
    for w in works:
        w.wait()
    assert torch.equal(got, _values((rank - 1) % world))


def _step(engine, batch, rank: int, world: int, inside=None) -> None:
    x, y = split_for_rank(batch, rank, world, 1, 0)
    engine.backward(loss_fn_for(engine.module)(engine(x), y))
    if inside is not None:
        inside()
    engine.step()


def _counts(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = build_model("mlp")
    engine, _, _, _ = meshzero.initialize(model=model, config=dict(CONFIG))
    batches = make_batches("mlp", 3, 4)
    _same_as_torch(rank, world)
    _ring_send(rank, world)
    _step(engine, batches[0], rank, world)  # the ops above: issued before the first step
    first = {key: row["count"] for key, row in engine.comm_stats.by_group().items()
             if key[1] == "world"}
    loss = torch.ones(3)
    _step(engine, batches[1], rank, world, inside=lambda: ds_dist.all_reduce(loss))
    report = engine.comm_report()
    ds_dist.broadcast(torch.ones(5), src=0)  # between steps: counted in the next one
    _step(engine, batches[2], rank, world)
    later = engine.comm_report()
    return {"first": first, "report": report, "later": later}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_equal_torch_and_count_in_comm_report(tmp_path, world_size):
    """Results equal torch.distributed's (deepspeed/comm/comm.py's functions call torch's
    through TorchBackend); every data-moving op counts once under meshzero's op name, phase
    ``user``, with ring bytes; one issued between steps shows in the next step's report."""
    results = run_distributed(_counts, world_size, tmp_path)
    for res in results:
        first = res["first"]
        ring = 2 if world_size > 1 else 0
        assert first[("all_reduce", "world")] == 2
        assert first[("all_gather", "world")] == 3  # into_tensor, allgather_fn, all_gather
        assert first[("reduce_scatter", "world")] == 1
        assert first[("broadcast", "world")] == 1
        assert first[("reduce", "world")] == first[("gather", "world")] == 1
        assert first[("scatter", "world")] == first[("all_to_all", "world")] == 1
        assert first.get(("send_recv", "world"), 0) == 2 * ring
        user = res["report"]["all_reduce"]["phases"]["user"]
        assert user["bytes"] == ring_bytes("all_reduce", 12, world_size)
        assert "user" not in res["later"].get("all_reduce", {}).get("phases", {})  # not carried on
        assert res["later"]["broadcast"]["phases"]["user"]["bytes"] == ring_bytes(
            "broadcast", 20, world_size)


def _fresh_init(rank: int, world: int) -> list:
    dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    ds_dist.init_distributed()
    ds_dist.init_distributed()  # already initialised: nothing to do, as DeepSpeed
    return [ds_dist.get_world_size(), ds_dist.get_rank(), ds_dist.get_local_rank(),
            ds_dist.get_backend()]


def test_init_distributed_without_torchrun_is_a_world_of_one(tmp_path):
    """deepspeed.comm.init_distributed without the launcher's env: DeepSpeed would try MPI
    discovery (comm.py mpi_discovery); meshzero makes a world of one (topology.py)."""
    assert run_distributed(_fresh_init, 1, tmp_path) == [[1, 0, 0, "gloo"]]


def test_configure_and_log_summary_say_what_they_do(caplog):
    """deepspeed.comm.configure switches DeepSpeed's comms logger: meshzero counts always
    and says so per argument; log_summary(show_straggler=True) raises naming the way."""
    with caplog.at_level("INFO", logger="meshzero.deepspeed"):
        ds_dist.configure(enabled=True, prof_all=True)
    assert sum("counts every collective" in r.message for r in caplog.records) == 2
    with pytest.raises(ValueError, match="comm_report"):
        ds_dist.log_summary(show_straggler=True)
    assert "summary" in ds_dist.log_summary(return_dict=True)

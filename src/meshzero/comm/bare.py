"""Blocking collectives over a bare process group (tensor-parallel layers, the pipeline,
checkpoints), counted by an ``on_comm`` callback, and the object collectives."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshzero.comm.stats import OnComm, failure_named, ring_bytes, tensor_bytes, where_of

# torch >= 2.10 renames the tensor collectives; keep working on 2.5.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_name(group: dist.ProcessGroup | None) -> str:
    """A bare group in an error: ``world``, or its global ranks."""
    if group is None or group is dist.group.WORLD:
        return "world"
    ranks = dist.get_process_group_ranks(group)
    return f"of ranks {ranks if len(ranks) <= 8 else [*ranks[:8], '...']}"


def _count(on_comm: OnComm | None, op: str, nbytes: int, group) -> None:
    if on_comm is not None:
        on_comm(op, ring_bytes(op, nbytes, _group_size(group)))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               on_comm: OnComm | None = None) -> None:
    """Sum ``tensor`` over ``group`` in place."""
    with failure_named("all_reduce", group_name(group), where_of(on_comm)):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    _count(on_comm, "all_reduce", tensor_bytes(tensor), group)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor,
                    group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """``output`` (N*S,) <- every rank's ``shard`` (S,), in rank order."""
    with failure_named("all_gather", group_name(group), where_of(on_comm)):
        all_gather_single(output, shard, group=group)
    _count(on_comm, "all_gather", tensor_bytes(output), group)


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor,
                        group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """``shard`` (S,) <- the sum over ranks of this rank's S-slice of ``full`` (N*S,)."""
    with failure_named("reduce_scatter", group_name(group), where_of(on_comm)):
        reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group)
    _count(on_comm, "reduce_scatter", tensor_bytes(full), group)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None,
              on_comm: OnComm | None = None) -> None:
    """``tensor`` <- global rank ``src``'s ``tensor``."""
    with failure_named("broadcast", group_name(group), where_of(on_comm)):
        dist.broadcast(tensor, src=src, group=group)
    _count(on_comm, "broadcast", tensor_bytes(tensor), group)


def start_exchange(pairs: list[tuple[int, torch.Tensor, torch.Tensor]],
                   group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Point-to-point, not waited on: for each ``(global peer, send, recv)`` post the send
    of ``send`` to the peer and the receive of its tensor into ``recv``; the works."""
    ops = []
    for peer, send, recv in pairs:
        ops.append(dist.P2POp(dist.isend, send, peer, group))
        ops.append(dist.P2POp(dist.irecv, recv, peer, group))
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(pairs: list[tuple[int, torch.Tensor, torch.Tensor]],
             group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """Point-to-point: for each ``(global peer, send, recv)`` send ``send`` to the peer and
    receive its tensor into ``recv``, all at once."""
    with failure_named("send_recv", group_name(group), where_of(on_comm)):
        for work in start_exchange(pairs, group):
            work.wait()
    if on_comm is not None and pairs:
        on_comm("send_recv", sum(tensor_bytes(send) for _, send, _ in pairs))


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj`` (in memory, between live ranks; never from files)."""
    out: list[Any] = [None] * _group_size(group)
    with failure_named("all_gather_object", group_name(group)):
        dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``obj`` on global rank ``dst`` (None elsewhere)."""
    is_dst = dist.get_rank() == dst
    out: list[Any] | None = [None] * _group_size(group) if is_dst else None
    with failure_named("gather_object", group_name(group)):
        dist.gather_object(obj, out, dst=dst, group=group)
    return out

"""A :class:`Communicator`: the collectives over one process group, asynchronous and
counted; on gloo over CPU it replaces gloo's all-gather and reduce-scatter (see the
package docstring)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm.bare import all_gather_single, reduce_scatter_single, start_exchange
from meshzero.comm.handle import Handle, WorkList
from meshzero.comm.quantize import dequantize_rows, quantize
from meshzero.comm.stats import CommStats, failure_named, ring_bytes, tensor_bytes


class Communicator:
    """Collectives over one process group, counted into shared :class:`CommStats`."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, stats: CommStats,
                 async_ops: bool = True, inter_node: bool = False,
                 point_to_point: bool = True):
        self.group = group
        self.inter_node = inter_node  # the group has ranks on more than one node
        self.name = name
        self.stats = stats
        # group None: an axis of size one (see topology.Topology.groups)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.async_ops = async_ops  # overlap_comm: False waits on every op at once
        self.gloo = group is not None and dist.get_backend(group) == "gloo"
        # all-gathers point-to-point on gloo (below); False: gloo's own, for a few bytes
        # (a control exchange: 0.34 ms against 2.1 ms point-to-point, 2 ranks, 16 bytes)
        self.point_to_point = point_to_point
        self.closed = False  # CommStats.drop_groups: the engine was closed
        self._global_ranks: list[int] | None = None  # the group's ranks, for send/recv
        # the stall watch's name of the group (faults/stall.py): the same on every rank
        self._key = "" if group is None else group.group_name
        stats.group_holders.append(self)

    def drop_groups(self) -> None:
        self.group = None
        self.closed = True

    def _launch(self, op: str, nbytes: int, fn, *buffers,
                then: Callable[[], object] | None = None) -> Handle:
        if self.closed:
            raise RuntimeError(f"{op} over group {self.name}: this engine was closed")
        stats = self.stats.get(self.name, op, self.inter_node)
        stats.count += 1
        stats.bytes += nbytes
        issued = time.perf_counter()
        if self.size == 1:  # a one-rank group: the local copy is the whole collective
            fn(None)
            if then is not None:
                then()
            return Handle(None, stats, issued, None, *buffers)
        describe = (op, self.name, self.stats.where())
        with failure_named(*describe):  # gloo may fail at issue too
            work = fn(self.group)
        handle = Handle(work, stats, issued, self.stats.pending, *buffers, describe=describe,
                        then=then, where_now=self.stats.where,
                        before_wait=self.stats.before_wait, watch=self._count_issued())
        if not self.async_ops:
            handle.wait()
        return handle

    def _count_issued(self) -> tuple | None:
        """Count an op issued over the group (the stall watch compares the ranks' counts);
        the Handle's ``watch`` where a wait on it may be made in slices: gloo."""
        stats, key = self.stats, self._key
        n = stats.issued[key] = stats.issued.get(key, 0) + 1
        if key not in stats.members:
            stats.members[key] = self._ranks()
        return (stats.watch, key, n) if self.gloo and stats.watch is not None else None

    def _ranks(self) -> list[int]:
        """The group's global ranks."""
        if self._global_ranks is None:
            self._global_ranks = dist.get_process_group_ranks(self.group)
        return self._global_ranks

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor,
                   op: str = "all_gather") -> Handle:
        """``output`` (N*S,) <- concat of every rank's ``shard`` (S,); counted under ``op``
        (stage 3's unit-order check is counted apart from the parameter all-gathers).

        On gloo over CPU it is point-to-point: ``shard`` is sent to every other rank and
        each rank's shard received straight into its slice of ``output``. Gloo's own
        all-gather receives into a fresh buffer of the output's size and copies it out
        (3.1x the time for a 77 MB shard at N=2: benchmarks/gloo_collectives.py); the
        bytes one rank sends are the same, ``B (N-1)/N``."""
        nbytes = ring_bytes("all_gather", tensor_bytes(output), self.size)

        def run(group):
            if group is None:
                output.copy_(shard)
                return None
            if self.gloo and self.point_to_point and output.device.type == "cpu":
                return self._gather_point_to_point(output, shard, group)
            return all_gather_single(output, shard, group=group, async_op=True)

        return self._launch(op, nbytes, run, output, shard)

    def all_gather_quantized(self, output: torch.Tensor, shard: torch.Tensor, *, block: int,
                             bits: int = 8) -> Handle:
        """ZeRO++ qwZ: ``output`` (N*S,) <- every rank's ``shard`` (S,), block-quantized
        (comm/quantize.py) on the way: one uint8 all-gather of the packed rows (scales and
        codes), dequantized into ``output`` at the wait. Counted as ``quantized_all_gather``
        with the packed bytes, ``L (N-1)`` for a row of L bytes. One rank (N = 1) still
        quantizes: what a rank computes with does not depend on the world size's being 1."""
        packed = quantize(shard, block, bits)
        rows = torch.empty(self.size * packed.numel(), dtype=torch.uint8, device=packed.device)
        numel = shard.numel()

        def run(group):
            if group is None:
                rows.copy_(packed)
                return None
            if self.gloo and self.point_to_point and rows.device.type == "cpu":
                return self._gather_point_to_point(rows, packed, group)
            return all_gather_single(rows, packed, group=group, async_op=True)

        def unpack() -> None:
            dequantize_rows(rows.view(self.size, -1), numel, block, bits,
                            output.view(self.size, numel))

        nbytes = ring_bytes("all_gather", tensor_bytes(rows), self.size)
        return self._launch("quantized_all_gather", nbytes, run, output, packed, rows,
                            then=unpack)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "all_to_all",
                   then: Callable[[], object] | None = None) -> Handle:
        """``output`` (N*C,) <- row r of every rank's ``tensor`` (N*C,): rank r's row of
        each; ``then`` runs at the wait. Counted under ``op``: one rank sends ``B (N-1)/N``
        of its B bytes (its own row stays)."""
        nbytes = tensor_bytes(tensor) * (self.size - 1) // max(self.size, 1)

        def run(group):
            if group is None:
                output.copy_(tensor)
                return None
            return dist.all_to_all_single(output, tensor, group=group, async_op=True)

        return self._launch(op, nbytes, run, output, tensor, then=then)

    def _gather_point_to_point(self, output: torch.Tensor, shard: torch.Tensor,
                               group: dist.ProcessGroup) -> WorkList:
        """Send ``shard`` to every peer and receive each peer's into its slice of
        ``output`` (each pair sends one message each way, so posting order cannot pair
        them wrongly)."""
        n, shard = shard.numel(), shard.contiguous()  # gloo sends contiguous memory
        works = start_exchange([(peer, shard, output[r * n:(r + 1) * n])
                                for r, peer in enumerate(self._ranks())
                                if r != self.rank], group)
        mine = output[self.rank * n:(self.rank + 1) * n]
        if mine.data_ptr() != shard.data_ptr():  # in place (stages 1-2): already there
            mine.copy_(shard)
        return WorkList(works)

    def reduces_by_all_to_all(self, full: torch.Tensor) -> bool:
        """Whether :meth:`reduce_scatter` of ``full`` goes by an all-to-all (gloo, CPU)."""
        return self.gloo and self.size > 1 and full.device.type == "cpu"

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor,
                       workspace: torch.Tensor | None = None) -> Handle:
        """``shard`` (S,) <- sum over ranks of ``full[r*S:(r+1)*S]`` (``full``: (N*S,)).

        On gloo over CPU (:meth:`reduces_by_all_to_all`) it is an all-to-all that brings
        every rank's slice for this rank into ``workspace`` (``full``'s size and dtype; a
        fresh one when None), summed into ``shard`` at the wait: gloo's own reduce-scatter
        copies ``full`` on the calling thread at issue (about half the op's time, stalling
        backward) and all-reduces the copy, sending twice the bytes. The all-to-all sends
        ``B (N-1)/N``, the ring reduce-scatter's count, and leaves ``full`` as it was."""
        nbytes = ring_bytes("reduce_scatter", tensor_bytes(full), self.size)
        if self.reduces_by_all_to_all(full):
            recv = torch.empty_like(full) if workspace is None else workspace
            rows = recv.view(self.size, shard.numel())

            def exchange(group):
                return dist.all_to_all_single(recv, full, group=group, async_op=True)

            return self._launch("reduce_scatter", nbytes, exchange, shard, full, recv,
                                then=lambda: torch.sum(rows, 0, out=shard))

        def run(group):
            if group is None:
                shard.copy_(full)
                return None
            return reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group,
                                   async_op=True)

        return self._launch("reduce_scatter", nbytes, run, shard, full)

    def all_reduce(self, tensor: torch.Tensor,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   name: str = "all_reduce") -> Handle:
        """Counted under ``name`` (the step's non-finite check apart from gradient data)."""
        nbytes = ring_bytes("all_reduce", tensor_bytes(tensor), self.size)

        def run(group):
            if group is None:
                return None
            return dist.all_reduce(tensor, op=op, group=group, async_op=True)

        return self._launch(name, nbytes, run, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        """``tensor`` <- global rank ``src``'s ``tensor``."""
        def run(group):
            return None if group is None else dist.broadcast(tensor, src=src, group=group,
                                                             async_op=True)

        return self._launch("broadcast", ring_bytes("broadcast", tensor_bytes(tensor), self.size),
                            run, tensor)


def broadcast_module(module: nn.Module, comm: Communicator, src: int) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers (as DeepSpeed
    does): one broadcast per dtype of everything flattened."""
    if comm.size == 1:
        return
    tensors = list(module.parameters()) + list(module.buffers())
    with torch.no_grad():
        # a fixed order on every rank: a set's order differs between processes, and rank 0
        # broadcasting fp32 while rank 1 expects int64 aborts gloo (or mixes equal sizes)
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            comm.broadcast(flat, src).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

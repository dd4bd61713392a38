"""Every collective goes through a :class:`Communicator`, which counts bytes and seconds.

Bytes are what one rank sends under the ring algorithms (the convention of nccl-tests' bus
bandwidth), so they can be compared with the ZeRO paper's formulas:

- all-gather of an output of B bytes over N ranks:      B * (N-1) / N
- reduce-scatter of an input of B bytes over N ranks:    B * (N-1) / N
- all-reduce of B bytes over N ranks:                  2 B * (N-1) / N

Seconds: ``seconds`` is the wall time during which at least one op of the kind was in
flight, from issue to completion (the union of those intervals). No completion callback is
attached to an op (see :class:`Handle`), so an op ends when its wait starts if it had
completed by then, else when its wait returns: an upper bound. ``exposed_seconds`` is the
time the caller spent blocked waiting, i.e. what was not hidden behind compute.

Lifecycle: every op is waited on by the code that issued it; ``CommStats.pending`` holds the
ops not waited on yet, so that ``Engine.close()`` (or the exit hook) can wait for or release
them before the interpreter shuts down.

Failures: a collective whose peers do not join within the group's timeout (``faults.
comm_timeout``), or whose peer died, raises :class:`CollectiveError` naming the op, the
group, the step and the phase, instead of gloo's or NCCL's bare error.

Every op is also counted by phase (``CommStats.phase``: forward, backward, step, set by the
engine) and as inside-node or across-node: a collective over a group whose ranks sit on more
than one node (``Topology.node_of``) counts all its bytes as across-node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch >= 2.10 renames the tensor collectives; keep working on 2.5.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OnComm = Callable[[str, int], None]  # (op, bytes this rank sent): a counter of a CommStats


class CollectiveError(RuntimeError):
    """A collective failed: a peer stalled past the timeout, died, or called another one."""


def where_in_training(step: int | None, phase: str) -> str:
    """Where a failed collective was: ``at step 3 (backward)``, or during initialize."""
    return "during initialize" if step is None else f"at step {step} ({phase})"


@contextmanager
def failure_named(op: str, group: str, where: str = "") -> Iterator[None]:
    """Turn a collective's RuntimeError into one :class:`CollectiveError` line that names
    ``op``, ``group`` and ``where`` training was."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        reason = (str(exc).strip().splitlines() or ["no message"])[0]
        raise CollectiveError(
            f"collective {op} over group {group} failed{f' {where}' if where else ''}: "
            f"{reason}. A rank stalled past the timeout (faults.comm_timeout), died, or "
            "called a different collective; see the other ranks' errors") from exc


def ring_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for ``op`` over ``n`` ranks under the ring algorithms; ``nbytes``
    is the all-gather's output, the reduce-scatter's input, the all-reduced or broadcast
    tensor (a broadcast pipelined along a ring sends B (N-1)/N per rank)."""
    if n <= 1:
        return 0
    return (2 if op == "all_reduce" else 1) * nbytes * (n - 1) // n


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class OpStats:
    count: int = 0
    bytes: int = 0
    inter_node: bool = False
    exposed_seconds: float = 0.0
    intervals: list[tuple[float, float]] = field(default_factory=list)  # (issued, done)

    @property
    def seconds(self) -> float:
        """Wall time during which at least one of these ops was in flight (the union of
        their intervals: prefetched ops that overlap each other are not counted twice)."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self.intervals):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total

    def add(self, other: OpStats) -> None:
        """Sum ``other`` into this (its intervals too, so the union stays right)."""
        self.count += other.count
        self.bytes += other.bytes
        self.intervals += other.intervals
        self.exposed_seconds += other.exposed_seconds

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "bytes": self.bytes, "seconds": self.seconds,
                "exposed_seconds": self.exposed_seconds}


@dataclass
class CommStats:
    """Counts per (group name, op). Shared by every communicator of an engine."""

    ops: dict[tuple[str, str, str], OpStats] = field(default_factory=dict)
    phase: str = "forward"
    step: int | None = None  # the optimizer step under way (None: initialize), for errors
    # ops issued and not waited on yet, by id(handle); a Handle removes itself on wait
    pending: dict[int, Handle] = field(default_factory=dict)
    # what holds the engine's process groups (every Communicator counting here, the mesh,
    # the pipeline): objects with a drop_groups() method
    group_holders: list[Any] = field(default_factory=list, repr=False)

    def drop_groups(self) -> None:
        """At the end of an engine: nothing of it holds a process group any more, so a group
        the user destroyed is freed (and gloo's threads joined) now, not during interpreter
        exit, where a thread still running can abort the process (docs/lifecycle.md)."""
        for holder in self.group_holders:
            holder.drop_groups()

    def finish_pending(self, block: bool = True) -> int:
        """Wait for every op not waited on yet (``block``), or (not ``block``: at exit after
        an error, when a peer may never join) release those that have completed. Returns
        how many were left in flight."""
        left = 0
        for handle in list(self.pending.values()):
            if block or handle.completed():
                handle.wait()
            else:
                left += 1
        return left

    def get(self, group: str, op: str, inter_node: bool = False) -> OpStats:
        stats = self.ops.setdefault((group, op, self.phase), OpStats())
        stats.inter_node = inter_node
        return stats

    def reset(self) -> None:
        self.ops.clear()

    def counter(self, group: str, inter_node: bool = False) -> OnComm:
        """``on_comm(op, nbytes)`` for collectives issued outside a Communicator (the tensor
        parallel layers, the pipeline schedule): one count and its bytes per call."""
        def count(op: str, nbytes: int) -> None:
            stats = self.get(group, op, inter_node)
            stats.count += 1
            stats.bytes += nbytes

        return count

    def by_op(self) -> dict[str, dict]:
        """``{op: {count, bytes, seconds, exposed_seconds, intra_node_bytes,
        inter_node_bytes, phases: {phase: {bytes, intra_node_bytes, inter_node_bytes}}}}``
        summed over groups."""
        out: dict[str, OpStats] = {}
        split: dict[str, dict] = {}
        for (_, op, phase), s in self.ops.items():
            acc = out.setdefault(op, OpStats())
            acc.add(s)
            where = "inter_node_bytes" if s.inter_node else "intra_node_bytes"
            per_op = split.setdefault(op, {"intra_node_bytes": 0, "inter_node_bytes": 0,
                                           "phases": {}})
            per_op[where] += s.bytes
            per_phase = per_op["phases"].setdefault(
                phase, {"bytes": 0, "intra_node_bytes": 0, "inter_node_bytes": 0})
            per_phase["bytes"] += s.bytes
            per_phase[where] += s.bytes
        return {op: {**s.as_dict(), **split[op]} for op, s in sorted(out.items())}

    def by_group(self) -> dict[tuple[str, str], dict]:
        """``{(op, group): {count, bytes, seconds, exposed_seconds}}`` summed over phases (the
        comms_logger's lines: by_op() sums the groups away)."""
        out: dict[tuple[str, str], OpStats] = {}
        for (group, op, _), s in self.ops.items():
            acc = out.setdefault((op, group), OpStats())
            acc.add(s)
        return {key: s.as_dict() for key, s in sorted(out.items())}


class Handle:
    """An in-flight collective. Holds references to its buffers until waited on.

    No completion callback (``work.get_future().then``) is attached: gloo would run the
    Python callback on its own C++ worker thread, which then needs the GIL, and torch warns
    that such a hook crashes the process if it runs after the interpreter has exited. The
    end of an op is taken from ``is_completed()`` at the start of its wait instead.
    """

    def __init__(self, work: dist.Work | None, stats: OpStats, issued: float,
                 pending: dict[int, Handle] | None, *buffers,
                 describe: tuple[str, str, str] | None = None,
                 then: Callable[[], object] | None = None):
        """``describe``: (op, group, where) for the error if the wait fails. ``then``: run
        on the waiting thread once the op has completed (part of the op: its exposed time)."""
        self._work = work
        self._then = then
        self._describe = describe
        self._stats = stats
        self._issued = issued
        self._buffers: tuple | None = buffers  # in-flight memory stays alive (no record_stream)
        self._pending = pending
        if pending is not None:
            pending[id(self)] = self

    def completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._buffers is None:
            return
        if self._work is not None:
            t0 = time.perf_counter()
            done_before = self._work.is_completed()
            self._wait_named()
            # completed before the wait: it ended by t0 and nothing was exposed; else it
            # ended as the wait returned; ``then`` (a local sum) is exposed either way
            t1 = t0 if done_before else time.perf_counter()
            if self._then is not None:
                t = time.perf_counter()
                self._then()
                t1 += time.perf_counter() - t
            self._stats.exposed_seconds += t1 - t0
            self._stats.intervals.append((self._issued, t1))
        self._forget()

    def _forget(self) -> None:
        """Done (or failed): let go of the op, its buffers and its place in ``pending``."""
        self._work, self._buffers, self._then = None, None, None
        if self._pending is not None:
            self._pending.pop(id(self), None)
            self._pending = None

    def _wait_named(self) -> None:
        assert self._work is not None
        if self._describe is None:
            self._work.wait()
            return
        try:
            self._work.wait()
        except RuntimeError:
            self._forget()  # a failed op is done; then say which one it was
            with failure_named(*self._describe):
                raise


class WorkList:
    """Several point-to-point ops that make up one collective, waited on as one.

    Gloo's send and receive works report ``is_completed()`` only once waited on (and a
    wait with a short timeout closes the connection), so the list is complete only after
    :meth:`wait`: the op's exposed time is still what the wait blocked, and its end is
    taken as the wait's return."""

    def __init__(self, works: list[dist.Work]):
        self.works = works
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.done = True
        return True


class Communicator:
    """Collectives over one process group, counted into shared :class:`CommStats`."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, stats: CommStats,
                 async_ops: bool = True, inter_node: bool = False):
        self.group = group
        self.inter_node = inter_node  # the group has ranks on more than one node
        self.name = name
        self.stats = stats
        # group None: an axis of size one (see topology.Topology.groups)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.async_ops = async_ops  # overlap_comm: False waits on every op at once
        self.gloo = group is not None and dist.get_backend(group) == "gloo"
        self.closed = False  # CommStats.drop_groups: the engine was closed
        self._global_ranks: list[int] | None = None  # the group's ranks, for send/recv
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
            return Handle(None, stats, issued, None, *buffers)
        describe = (op, self.name, where_in_training(self.stats.step, self.stats.phase))
        with failure_named(*describe):  # gloo may fail at issue too
            work = fn(self.group)
        handle = Handle(work, stats, issued, self.stats.pending, *buffers, describe=describe,
                        then=then)
        if not self.async_ops:
            handle.wait()
        return handle

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor,
                   op: str = "all_gather") -> Handle:
        """``output`` (N*S,) <- concat of every rank's ``shard`` (S,); counted under ``op``
        (stage 3's unit-order check is counted apart from the parameter all-gathers).

        On gloo over CPU it is point-to-point: ``shard`` is sent to every other rank and
        each rank's shard received straight into its slice of ``output``. Gloo's own
        all-gather receives into a fresh buffer of the output's size and copies it out
        (3.1x the time for a 77 MB shard at N=2: benchmarks/gloo_collectives.py); the
        bytes one rank sends are the same, ``B (N-1)/N``."""
        nbytes = ring_bytes("all_gather", _size(output), self.size)

        def run(group):
            if group is None:
                output.copy_(shard)
                return None
            if self.gloo and output.device.type == "cpu":
                return self._gather_point_to_point(output, shard, group)
            return _all_gather(output, shard, group=group, async_op=True)

        return self._launch(op, nbytes, run, output, shard)

    def _gather_point_to_point(self, output: torch.Tensor, shard: torch.Tensor,
                               group: dist.ProcessGroup) -> WorkList:
        """Send ``shard`` to every peer and receive each peer's into its slice of
        ``output``: rank r sends to r+1, r+2, ... and receives from r-1, r-2, ..., so that
        every pair's messages are posted in the same order on both sides."""
        n, shard = shard.numel(), shard.contiguous()  # gloo sends contiguous memory
        if self._global_ranks is None:
            self._global_ranks = dist.get_process_group_ranks(group)
        works: list[dist.Work] = []
        for step in range(1, self.size):
            to, frm = (self.rank + step) % self.size, (self.rank - step) % self.size
            sent = dist.isend(shard, self._global_ranks[to], group=group)
            got = dist.irecv(output[frm * n:(frm + 1) * n], self._global_ranks[frm],
                             group=group)
            assert sent is not None and got is not None  # this rank is in the group
            works += [sent, got]
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
        nbytes = ring_bytes("reduce_scatter", _size(full), self.size)
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
            return _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group,
                                   async_op=True)

        return self._launch("reduce_scatter", nbytes, run, shard, full)

    def all_reduce(self, tensor: torch.Tensor,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   name: str = "all_reduce") -> Handle:
        """Counted under ``name`` (the step's non-finite check apart from gradient data)."""
        nbytes = ring_bytes("all_reduce", _size(tensor), self.size)

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

        return self._launch("broadcast", ring_bytes("broadcast", _size(tensor), self.size),
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


# -- blocking collectives over a bare group (tp layers, pipeline), counted by ``on_comm`` ----
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
    with failure_named("all_reduce", group_name(group)):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    _count(on_comm, "all_reduce", _size(tensor), group)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor,
                    group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """``output`` (N*S,) <- every rank's ``shard`` (S,), in rank order."""
    with failure_named("all_gather", group_name(group)):
        _all_gather(output, shard, group=group)
    _count(on_comm, "all_gather", _size(output), group)


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor,
                        group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """``shard`` (S,) <- the sum over ranks of this rank's S-slice of ``full`` (N*S,)."""
    with failure_named("reduce_scatter", group_name(group)):
        _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group)
    _count(on_comm, "reduce_scatter", _size(full), group)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None,
              on_comm: OnComm | None = None) -> None:
    """``tensor`` <- global rank ``src``'s ``tensor``."""
    with failure_named("broadcast", group_name(group)):
        dist.broadcast(tensor, src=src, group=group)
    _count(on_comm, "broadcast", _size(tensor), group)


def exchange(pairs: list[tuple[int, torch.Tensor, torch.Tensor]],
             group: dist.ProcessGroup | None, on_comm: OnComm | None = None) -> None:
    """Point-to-point: for each ``(global peer, send, recv)`` send ``send`` to the peer and
    receive its tensor into ``recv``, all at once."""
    ops = []
    for peer, send, recv in pairs:
        ops.append(dist.P2POp(dist.isend, send, peer, group))
        ops.append(dist.P2POp(dist.irecv, recv, peer, group))
    with failure_named("send_recv", group_name(group)):
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    if on_comm is not None and pairs:
        on_comm("send_recv", sum(_size(send) for _, send, _ in pairs))


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

"""What the collectives are counted in: bytes one rank sends under the ring algorithms,
seconds in flight and exposed, by group, op and phase; and the error a failed collective
raises, naming the op, the group and where in training it was."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from meshzero.comm.handle import Handle

OnComm = Callable[[str, int], None]  # (op, bytes this rank sent): a counter of a CommStats
Where = str | Callable[[], str]  # where training is, for an error: fixed, or asked at failure


class CollectiveError(RuntimeError):
    """A collective failed: a peer stalled past the timeout, died, or called another one."""


def where_in_training(step: int | None, phase: str) -> str:
    """Where a failed collective was: ``at step 3 (backward)``, or during initialize."""
    return "during initialize" if step is None else f"at step {step} ({phase})"


def waited_where(now: str, issued: str) -> str:
    """Where a rank waited on an op, and where it issued it when that differs: ``at step 2
    (checkpoint save; issued at step 2 (backward))``."""
    if now == issued or not issued:
        return now
    return f"{now[:-1]}; issued {issued})" if now.endswith(")") else f"{now} (issued {issued})"


@contextmanager
def failure_named(op: str, group: str, where: Where = "") -> Iterator[None]:
    """Turn a collective's RuntimeError into one :class:`CollectiveError` line that names
    ``op``, ``group`` and ``where`` training was (a callable: asked when it fails, so the
    error names the phase the rank was in as it waited)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        reason = (str(exc).strip().splitlines() or ["no message"])[0]
        where = where() if callable(where) else where
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


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Counter:
    """``on_comm(op, nbytes)`` of a :class:`CommStats` for collectives issued outside a
    Communicator (the tensor-parallel layers, the pipeline): counts each call, and says
    where training is for the error of one that fails (:meth:`where`)."""

    def __init__(self, stats: CommStats, group: str, inter_node: bool):
        self.stats, self.group, self.inter_node = stats, group, inter_node

    def __call__(self, op: str, nbytes: int) -> None:
        stats = self.stats.get(self.group, op, self.inter_node)
        stats.count += 1
        stats.bytes += nbytes

    def where(self) -> str:
        return self.stats.where()


def where_of(on_comm: OnComm | None) -> Where:
    """Where training is, for a collective counted by ``on_comm`` (asked at failure)."""
    return on_comm.where if isinstance(on_comm, Counter) else ""


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


# every CommStats alive, weakly (an engine's lives as long as the engine): where collectives
# the user issues outside the engine are counted (comm/user.py)
_LIVE: weakref.WeakValueDictionary[int, CommStats] = weakref.WeakValueDictionary()


def live_stats() -> list[CommStats]:
    """The :class:`CommStats` alive now (every live engine's)."""
    return list(_LIVE.values())


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
    # a check posted ahead and not waited on (faults/phase.py): run before any op's wait
    gate: Callable[[], None] | None = field(default=None, repr=False)
    # ops issued per process group (its name) and each group's global ranks, and the stall
    # watch that reads them when a gloo wait stalls (faults/stall.py; None: no watch)
    issued: dict[str, int] = field(default_factory=dict, repr=False)
    members: dict[str, list[int]] = field(default_factory=dict, repr=False)
    watch: Any = field(default=None, repr=False)
    # collectives the user issued outside the engine (comm/user.py), by (step they were
    # issued at, group, op): those issued between two steps are counted in the next one
    user_carry: dict[tuple[int | None, str, str], OpStats] = field(default_factory=dict,
                                                                   repr=False)

    def __post_init__(self) -> None:
        _LIVE[id(self)] = self  # weakly: user collectives count here while it lives

    def before_wait(self) -> None:
        """Before a rank blocks on a collective: settle the check posted ahead (``gate``),
        which raises if the ranks are in different engine calls, so a rank never waits for
        a peer that will not come."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate()

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

    def where(self) -> str:
        """Where training is now, for the error of a collective: ``at step 3 (backward)``."""
        return where_in_training(self.step, self.phase)

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Count and name the collectives inside as ``phase`` (a checkpoint save between two
        steps is not the last step's phase), then go back to the phase before."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def get(self, group: str, op: str, inter_node: bool = False,
            phase: str | None = None) -> OpStats:
        stats = self.ops.setdefault((group, op, phase or self.phase), OpStats())
        stats.inter_node = inter_node
        return stats

    def reset(self) -> None:
        """A new accounting window (the engine's step ``self.step``): forget the ops counted,
        but keep the user's collectives issued since the last step closed (counted at this
        step) or during initialize."""
        self.ops.clear()
        kept = {key: s for key, s in self.user_carry.items() if key[0] in (None, self.step)}
        self.user_carry = {}
        for (_, group, op), s in kept.items():
            self.count_user(group, op, s.bytes, s.exposed_seconds, count=s.count)

    def count_user(self, group: str, op: str, nbytes: int, seconds: float = 0.0, *,
                   count: int = 1) -> None:
        """Count a collective the user issued outside the engine (DeepSpeed's comm names,
        comm/user.py) under phase ``user``: ``nbytes`` this rank sent, ``seconds`` it
        blocked."""
        for stats in (self.get(group, op, phase="user"),
                      self.user_carry.setdefault((self.step, group, op), OpStats())):
            stats.count += count
            stats.bytes += nbytes
            stats.exposed_seconds += seconds

    def counter(self, group: str, inter_node: bool = False) -> Counter:
        """``on_comm(op, nbytes)`` for collectives issued outside a Communicator (the tensor
        parallel layers, the pipeline schedule): one count and its bytes per call."""
        return Counter(self, group, inter_node)

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

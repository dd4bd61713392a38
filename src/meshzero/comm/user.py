"""Collectives the user issues outside the engine, counted in every live engine's report.

Training code calls collectives of its own (a loss averaged for logging, a metric gathered,
a tensor broadcast), through DeepSpeed's ``comm`` names or directly. ``count_user_collective``
counts one into each live engine's :class:`CommStats` (a weak registry: an engine that is
gone counts nothing), under phase ``user`` and meshzero's op names, with the bytes this rank
sends under the ring algorithms (``ring_bytes``). One issued inside a step shows in that
step's ``engine.comm_report()``; one issued between two steps (or before the first) shows in
the next step's. Seconds are those the caller blocked (``exposed_seconds``); an op issued
with ``async_op=True`` counts no seconds.
"""

from __future__ import annotations

import torch.distributed as dist

from meshzero.comm.bare import group_name
from meshzero.comm.stats import live_stats, ring_bytes

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def user_bytes(op: str, nbytes: int, group: dist.ProcessGroup | None) -> int:
    """Bytes one rank sends for ``op`` of ``nbytes`` (``ring_bytes``'s convention; a reduce
    as a broadcast: B (N-1)/N); other ops: ``nbytes`` as given (what the rank sends)."""
    if op not in RING_OPS:
        return nbytes
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    return ring_bytes("broadcast" if op == "reduce" else op, nbytes, n)


def count_user_collective(op: str, nbytes: int, group: dist.ProcessGroup | None = None,
                          seconds: float = 0.0) -> None:
    """Count one collective the user issued: ``op`` (meshzero's name: all_reduce,
    all_gather, reduce_scatter, broadcast, reduce, gather, scatter, all_to_all, send_recv)
    of ``nbytes`` (the all-reduced / broadcast tensor, the all-gather's output, the
    reduce-scatter's input; for the others what this rank sends) over ``group`` (None: the
    world), which blocked the caller ``seconds``, in every live engine's CommStats."""
    stats = live_stats()
    if not stats:
        return
    name = group_name(group) if dist.is_initialized() else "world"
    sent = user_bytes(op, nbytes, group)
    for s in stats:
        s.count_user(name, op, sent, seconds)

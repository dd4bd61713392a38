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
engine; a checkpoint save or load, ``full_state_dict``, a 16-bit save or a weights load
between steps is its own phase, ``CommStats.in_phase``), and a failed one names the phase the
rank was in as it waited (and where it issued the op, when that differs). Ops count as
inside-node or across-node: a collective over a group whose ranks sit on more than one node
(``Topology.node_of``) counts all its bytes as across-node.

The package: ``stats.py`` (counting, the error), ``handle.py`` (ops in flight),
``communicator.py`` (:class:`Communicator`), ``bare.py`` (blocking collectives over a bare
group, counted by a callback).
"""

from meshzero.comm.bare import (
    all_gather_into,
    all_gather_objects,
    all_reduce,
    broadcast,
    exchange,
    gather_objects,
    group_name,
    reduce_scatter_into,
)
from meshzero.comm.communicator import Communicator, broadcast_module
from meshzero.comm.handle import Handle, WorkList
from meshzero.comm.stats import (
    CollectiveError,
    CommStats,
    Counter,
    OnComm,
    OpStats,
    failure_named,
    ring_bytes,
    where_in_training,
)

__all__ = ["CollectiveError", "CommStats", "Communicator", "Counter", "Handle", "OnComm", "OpStats",
           "WorkList", "all_gather_into", "all_gather_objects", "all_reduce", "broadcast",
           "broadcast_module", "exchange", "failure_named", "gather_objects", "group_name",
           "reduce_scatter_into", "ring_bytes", "where_in_training"]

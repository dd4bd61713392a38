"""What dynamo did during one call, from its own counters: frames compiled, graph breaks,
recompiles (guard failures) and compile seconds, each with its reasons.

Dynamo's counters are process-wide (``torch._dynamo.utils.counters``, ``guard_failures``,
``compilation_time_metrics``); a compiled unit's forward reads them before and after its call,
so what compiled in between is that unit's: a compile runs inside the call that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures

_COMPILE_TIMER = "_compile.compile_inner"  # dynamo's whole compile of one frame


@dataclass(frozen=True)
class Snapshot:
    frames: int  # frame compiles: dynamo times each (counters["frames"] skips fullgraph ones)
    graphs: int
    breaks: dict[str, int]
    failures: int


def _frames() -> int:
    return len(compilation_time_metrics.get(_COMPILE_TIMER, ()))


def snapshot() -> Snapshot:
    """Dynamo's counters now (a few dict reads: cheap enough for every unit call)."""
    return Snapshot(frames=_frames(), graphs=counters["stats"]["unique_graphs"],
                    breaks=dict(counters["graph_break"]),
                    failures=sum(len(v) for v in guard_failures.values()))


@dataclass
class Delta:
    """What compiled between two snapshots."""

    frames: int = 0
    graphs: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    compile_seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)  # of the breaks and recompiles

    @property
    def empty(self) -> bool:
        return self.frames == 0 and self.graph_breaks == 0

    def add(self, other: Delta) -> None:
        self.frames += other.frames
        self.graphs += other.graphs
        self.graph_breaks += other.graph_breaks
        self.recompiles += other.recompiles
        self.compile_seconds += other.compile_seconds


def since(before: Snapshot) -> Delta:
    """What dynamo compiled since ``before`` (nothing, on the hot path: one comparison)."""
    if _frames() == before.frames and dict(counters["graph_break"]) == before.breaks:
        return Delta()
    now = snapshot()
    reasons = []
    breaks = 0
    for reason, count in now.breaks.items():
        new = count - before.breaks.get(reason, 0)
        if new > 0:
            breaks += new
            reasons.append("graph break: " + reason.splitlines()[0])
    failures = [r for v in guard_failures.values() for r in v]
    recompiles = now.failures - before.failures
    if recompiles > 0:  # the newest failures (dicts keep insertion order per code object)
        reasons += ["recompile: " + r.splitlines()[0] for r in failures[-recompiles:]]
    times = compilation_time_metrics.get(_COMPILE_TIMER, [])
    return Delta(frames=now.frames - before.frames, graphs=now.graphs - before.graphs,
                 graph_breaks=breaks, recompiles=max(recompiles, 0),
                 compile_seconds=float(sum(times[before.frames:])), reasons=reasons)

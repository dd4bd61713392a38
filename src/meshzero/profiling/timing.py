"""Time without stopping the device: a timeline of marks, read once at the end.

A :class:`Timeline` makes marks on the hot path and turns pairs of marks into seconds later.
On CPU a mark is a ``time.perf_counter()`` timestamp and nothing else. On CUDA a mark is an
event recorded on the current (compute) stream: recording costs a few microseconds and never
waits, and the seconds between two events are the device's own time between the points the
stream reached. Reading them waits once, for the last mark (:meth:`Timeline.wait`), never per
module, so the host keeps running ahead of the device as it does in an unprofiled step.

:class:`StepClock` is the engine's per-step timing on the same timeline: one mark when an
optimizer step's window opens (its first forward) and one when ``step()`` ends. Those steps'
seconds are the monitors' ``step_time`` and the profiler's headline (the median of the last K
unprofiled steps after the first), one set of numbers. Module times use the same kind of
marks, pooled (:mod:`meshzero.profiling.marks`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Timeline(Protocol):
    def mark(self) -> Any:
        """A point in time on the hot path (no waiting)."""
        ...

    def wait(self, mark: Any) -> None:
        """Block until ``mark`` is reached (no-op on CPU); once, before reading."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; both must have been reached (see wait)."""
        ...


class CpuTimeline:
    """Marks are host timestamps: the CPU is the device."""

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self, mark: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaTimeline:
    """Marks are CUDA events on the stream current when marking (the compute stream: ZeRO's
    collectives and copies run on their own streams, ordered by event waits)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # returns at once after wait(); guards marks on other streams
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def timeline_for(device: torch.device) -> Timeline:
    return CudaTimeline(device) if device.type == "cuda" else CpuTimeline()


@dataclass
class StepTime:
    step: int  # the optimizer step's index (engine.global_steps while it ran)
    start: Any
    end: Any
    profiled: bool  # the profiler's step P or its FLOP-counting step P-1
    timed: bool = True  # False: no start mark


class StepClock:
    """The window of every optimizer step, from its first forward to the end of ``step()``,
    for the last ``keep`` steps. Marking costs a timestamp (CPU) or an event record (CUDA);
    nothing waits until a figure is read."""

    def __init__(self, timeline: Timeline, keep: int = 64) -> None:
        self.timeline = timeline
        self.steps: deque[StepTime] = deque(maxlen=keep)
        self._start: Any = None

    def open(self) -> None:
        self._start = self.timeline.mark()

    def close(self, step: int, profiled: bool) -> None:
        end = self.timeline.mark()
        # a step whose window never opened (a backward outside engine.forward) has no start:
        # it reads 0 s and never enters a median
        timed = self._start is not None
        self.steps.append(StepTime(step, self._start if timed else end, end, profiled, timed))
        self._start = None

    def seconds(self, record: StepTime) -> float:
        self.timeline.wait(record.end)
        return self.timeline.seconds(record.start, record.end)

    def last_seconds(self) -> float:
        """Seconds of the last closed step (waits for it on CUDA)."""
        return self.seconds(self.steps[-1])

    def steady(self, k: int) -> list[StepTime]:
        """The last ``k`` unprofiled steps after step 0 (which records the unit order and
        warms the allocator up), oldest first."""
        return [s for s in self.steps if not s.profiled and s.timed and s.step >= 1][-k:]

    def median(self, records: list[StepTime]) -> float:
        return statistics.median(self.seconds(r) for r in records)

"""Host <-> device copies of the offload tiers: one code path, counted, overlapped on CUDA.

Every byte an offload tier moves between the compute device and its host buffers goes
through :class:`Transfers`, and every byte it moves to or from its files is counted here:

    d2h         reduced gradient shards, device -> host gradient shard (or a staging buffer)
    h2d         updated parameters and stage-3 parameter shards, host -> device
    nvme_read   files -> host buffers (optimizer tiles, gradients, parameter shards)
    nvme_write  host buffers -> files

On CUDA a copy never goes through pageable memory (torch would then copy synchronously,
through a temporary, inside backward) and never blocks the training thread:

- the host side is a page-locked buffer allocated once: the tier's own (gradient shard,
  master, parameter shard) or a staging buffer from :class:`StagingPool`, reused;
- the copy runs on one dedicated copy stream, after an event recorded on the compute
  stream (the copy sees what compute wrote), with ``non_blocking=True``;
- the source (device -> host) or staging buffer (host -> device) is held until the copy's
  end event has completed, instead of ``record_stream``, so memory stays deterministic;
- work that reads a landed host buffer (adding a micro-step's gradient, the unit's CPU
  step) runs on the :class:`UnitStepper` worker thread after that event, in submission
  order; compute waits for host -> device copies with a stream-side event wait
  (:meth:`Transfers.join_compute`), never a ``synchronize()``.

Without CUDA the device is the CPU: the same calls copy synchronously, ``then`` runs at
once, and the counters count the copies between the device and host tiers, so tests can
hold them to the formula. With ``MESHZERO_OFFLOAD_COPIES=thread`` the copies run later on a
thread instead (:class:`ThreadStream`), so the CPU exercises the asynchronous path; with
``MESHZERO_OFFLOAD_COPIES=sync`` CUDA copies block instead (to tell a fault of the overlap).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch

DIRECTIONS = ("d2h", "h2d", "nvme_read", "nvme_write")
WORKERS = "meshzero-"  # the name prefix of every thread of ours (steps, copies, file I/O)


def on_compute() -> bool:
    """Whether the calling thread issues compute: the training thread, and also autograd's
    device thread, which runs backward's hooks (stage 3 gathers a unit's shards there) on
    CUDA. Only meshzero's own worker threads are not: their copies join compute later."""
    return not threading.current_thread().name.startswith(WORKERS)


class UnitStepper:
    """One worker thread, running submitted work in order (unit steps, landed gradients)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix=WORKERS + "step")
            self._futures.append(self._pool.submit(fn))

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def wait(self) -> None:
        """Wait for everything submitted; re-raise the first error."""
        with self._lock:
            futures, self._futures = self._futures, []
        error = None
        for f in futures:
            exc = f.exception()
            error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class DirectionStats:
    """One direction's copies: bytes, seconds the copies took, seconds the training thread
    was blocked by them, how many, and how many had a page-locked host side."""

    bytes: int = 0
    seconds: float = 0.0
    exposed_seconds: float = 0.0
    count: int = 0
    pinned_count: int = 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class StagingPool:
    """Page-locked (when ``pin``) host buffers by (numel, dtype), allocated once and reused:
    a buffer goes back when the copy that used it has completed."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0  # bytes of every buffer made (memory_report's offload_buffers)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            spare = self._free.get((numel, dtype))
            if spare:
                return spare.pop()
            self.nbytes += numel * dtype.itemsize
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((t.numel(), t.dtype), []).append(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.view(-1).copy_(src.reshape(-1))
    return time.perf_counter() - t0


class ThreadEvent:
    """A copy on the :class:`ThreadStream`: done, or waited for, like a CUDA event."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()

    def query(self) -> bool:
        return self.future.done()

    def seconds(self) -> float:
        return self.future.result()


class ThreadStream:
    """The copy stream without CUDA, for tests (``MESHZERO_OFFLOAD_COPIES=thread``): copies
    run later, in issue order, on one thread, so the CPU runs the asynchronous path (held
    buffers, landing on the worker, joins) and an ordering fault shows up as a wrong value.
    Compute is the host here: joining it waits for the copy."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=WORKERS + "copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> ThreadEvent:
        return ThreadEvent(self._pool.submit(_timed_copy, dst, src))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StepTransfers:
    """The copies of one step; :meth:`report` gives ``{direction: {bytes, seconds,
    exposed_seconds, count, pinned_count}}`` (waiting for CUDA copies still in flight)."""

    def __init__(self, stats: dict[str, DirectionStats] | None = None,
                 timed: list | None = None) -> None:
        self._stats = stats or {d: DirectionStats() for d in DIRECTIONS}
        self._timed = timed or []

    def report(self) -> dict[str, dict]:
        for direction, seconds in self._timed:  # each waits for its copy
            self._stats[direction].seconds += seconds()
        self._timed = []
        return {d: s.as_dict() for d, s in self._stats.items()}


class Transfers:
    """The copies of one rank's offload tier, and their counters (module docstring)."""

    def __init__(self, device: torch.device, pin: bool, simulate: bool | None = None) -> None:
        """``simulate``: without CUDA, copy on a :class:`ThreadStream` (default: when
        ``MESHZERO_OFFLOAD_COPIES=thread``) instead of synchronously."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin
        mode = os.environ.get("MESHZERO_OFFLOAD_COPIES", "")
        if simulate is None:
            simulate = mode == "thread"
        self.threads = ThreadStream() if simulate and not self.cuda else None
        # "sync": blocking copies on CUDA too (a diagnosis: does a fault follow the overlap?)
        self.asynchronous = (self.cuda and mode != "sync") or self.threads is not None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._compute = torch.cuda.current_stream(device) if self.cuda else None
        self.staging = StagingPool(pin)
        self.worker = UnitStepper()
        self._stats = {d: DirectionStats() for d in DIRECTIONS}
        self._lock = threading.Lock()
        # copies in flight on CUDA: (end event, what to hold or give back until it is done)
        self._inflight: deque[tuple[Any, tuple, Callable[[], None] | None]] = deque()
        self._timed: list[tuple[str, Callable[[], float]]] = []
        self._last_h2d: Any = None  # a torch.cuda.Event or a ThreadEvent

    # -- copies ------------------------------------------------------------------------------
    def to_host(self, dst: torch.Tensor, src: torch.Tensor,
                then: Callable[[], None] | None = None) -> None:
        """``src`` (device) into ``dst`` (host, same numel and dtype). ``then`` reads the
        landed ``dst``: on CUDA it runs on the worker after the copy, else at once."""
        assert dst.dtype == src.dtype and dst.numel() == src.numel(), "a plain copy"
        if not self.asynchronous:
            self._copy_now("d2h", dst, src)
            if then is not None:
                then()
            return
        end = self._copy_async("d2h", dst, src)
        # the worker runs in order: what it runs after this has the landed dst too

        def land() -> None:
            end.synchronize()
            if then is not None:
                then()

        self.worker.submit(land)

    def to_host_staged(self, src: torch.Tensor, then: Callable[[torch.Tensor], object]) -> None:
        """``src`` (device) into a staging host buffer; ``then(buffer)`` reads it once it
        has landed (the buffer goes back to the pool after)."""
        buf = self.staging.take(src.numel(), src.dtype)

        def land() -> None:
            try:
                then(buf)
            finally:
                self.staging.give(buf)

        self.to_host(buf, src, land)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor,
                  release: Callable[[], None] | None = None) -> None:
        """``src`` (host) into ``dst`` (device), converted to ``dst``'s dtype; ``release``
        runs once ``src`` may be reused. On CUDA a conversion is done on the host into a
        staging buffer of ``dst``'s dtype (never a temporary: torch converts a blocking
        cross-device copy through pageable memory), which then crosses on the copy stream.
        Issued by a compute thread (:func:`on_compute`: the training thread or autograd's),
        compute waits for it at once (on the GPU); from a worker, at :meth:`join_compute`."""
        if not self.asynchronous:
            self._copy_now("h2d", dst, src)
            if release is not None:
                release()
            return
        host = src.reshape(-1)
        if src.dtype != dst.dtype or (self.pin and not src.is_pinned()):
            host = self.staging.take(dst.numel(), dst.dtype)
            host.copy_(src.reshape(-1))
            if release is not None:
                release()
            release = lambda: self.staging.give(host)  # noqa: E731
        self._copy_async("h2d", dst, host, release=release)
        if on_compute():
            self.join_compute()

    def _copy_now(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dst.view(-1).copy_(src.reshape(-1))
        seconds = time.perf_counter() - t0
        host = dst if direction == "d2h" else src
        self._count(direction, _nbytes(dst), seconds, host.is_pinned())

    def _copy_async(self, direction: str, dst: torch.Tensor, src: torch.Tensor,
                    release: Callable[[], None] | None = None) -> Any:
        t0 = time.perf_counter()
        if self.threads is not None:
            end: Any = self.threads.copy(dst, src)
            seconds = end.seconds
        else:
            end, seconds = self._copy_on_stream(dst, src)
        with self._lock:  # src and dst alive until the copy is done (no record_stream)
            self._inflight.append((end, (src, dst), release))
            self._timed.append((direction, seconds))
            if direction == "h2d":
                self._last_h2d = end
        host = dst if direction == "d2h" else src
        self._count(direction, _nbytes(dst), 0.0, host.is_pinned(),
                    exposed=time.perf_counter() - t0)
        self._retire(block=False)
        return end

    def _copy_on_stream(self, dst: torch.Tensor, src: torch.Tensor):
        """On the copy stream, after what compute wrote so far; (end event, its timer)."""
        assert self.stream is not None
        ready = torch.cuda.Event()
        ready.record(self._compute_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the worker thread's current device may be another rank's: name ours
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start.record(self.stream)
            dst.view(-1).copy_(src.reshape(-1), non_blocking=True)
            end.record(self.stream)

        def seconds() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return end, seconds

    def _retire(self, block: bool) -> None:
        """Let go of what completed copies held (all of them, waiting, if ``block``)."""
        while True:
            with self._lock:
                if not self._inflight:
                    return
                end, _, release = self._inflight[0]
                if not block and not end.query():
                    return
                self._inflight.popleft()
            if block:
                t0 = time.perf_counter()
                end.synchronize()
                self._expose(time.perf_counter() - t0, "d2h")
            if release is not None:
                release()

    # -- ordering --------------------------------------------------------------------------
    def on_copy_stream(self) -> Any:
        """A context in which work queues on the copy stream (CUDA; else nothing changes):
        a read of values the copies already waited for, without waiting for compute."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def join_compute(self) -> None:
        """Compute waits (on the GPU, not the host) for the host -> device copies issued so
        far; a no-op on CPU."""
        with self._lock:
            end, self._last_h2d = self._last_h2d, None
        if end is None:
            return
        if self.threads is not None:  # compute is this thread: wait for the copy
            t0 = time.perf_counter()
            end.synchronize()
            self._expose(time.perf_counter() - t0, "h2d")
        else:
            self._compute_stream().wait_event(end)

    def _compute_stream(self) -> torch.cuda.Stream:
        """A compute thread's current stream (a worker's own current stream is the default
        one: it must order against the stream compute last ran on)."""
        if on_compute():
            self._compute = torch.cuda.current_stream(self.device)
        assert self._compute is not None  # on CUDA only
        return self._compute

    def wait(self) -> None:
        """Every copy has completed and every ``then`` has run (host buffers may be read)."""
        self.worker.wait()
        self._retire(block=True)

    # -- counters ------------------------------------------------------------------------------
    def count_nvme(self, writing: bool, nbytes: int, seconds: float) -> None:
        """A file read or write of ``nbytes`` that took ``seconds`` (nvme_io.NvmeFile)."""
        self._count("nvme_write" if writing else "nvme_read", nbytes, seconds, False)

    def _count(self, direction: str, nbytes: int, seconds: float, pinned: bool,
               exposed: float | None = None) -> None:
        on_main = on_compute()
        with self._lock:
            s = self._stats[direction]
            s.bytes += nbytes
            s.seconds += seconds
            s.count += 1
            s.pinned_count += int(pinned)
            if on_main:
                s.exposed_seconds += seconds if exposed is None else exposed

    def _expose(self, seconds: float, direction: str) -> None:
        """A compute thread waited ``seconds`` for copies (a wait for everything is
        charged to d2h: the host waits for gradients to land before it reads them)."""
        if on_compute():
            with self._lock:
                self._stats[direction].exposed_seconds += seconds

    def take(self) -> StepTransfers:
        """The copies since the last ``take`` (one optimizer step); the counters start again
        at zero. No wait: CUDA copy times are read from their events when reported."""
        with self._lock:
            stats, self._stats = self._stats, {d: DirectionStats() for d in DIRECTIONS}
            timed, self._timed = self._timed, []
        return StepTransfers(stats, timed)

    def close(self) -> None:
        self.worker.close()
        if self.threads is not None:
            self.threads.close()

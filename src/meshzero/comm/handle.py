"""An in-flight collective (:class:`Handle`), and several point-to-point ops waited on as
one (:class:`WorkList`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from meshzero.comm.stats import CollectiveError, OpStats, failure_named, waited_where


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
                 then: Callable[[], object] | None = None,
                 where_now: Callable[[], str] | None = None,
                 before_wait: Callable[[], None] | None = None,
                 watch: tuple | None = None):
        """``describe``: (op, group, where it was issued) for the error if the wait fails;
        ``where_now``: where training is as the rank waits, named first in that error (a
        reduction issued in backward and waited on in a checkpoint save fails in the save).
        ``then``: run on the waiting thread once the op has completed (part of the op: its
        exposed time). ``before_wait``: called before blocking on the op (the check posted
        ahead, CommStats.before_wait), unless the op has completed already: then the wait
        cannot block, and the check is settled at a later wait, when more likely done.
        ``watch``: (the stall watch, the op's group, its number there): the wait is made in
        slices and a stall reported between them (faults/stall.py)."""
        self._work = work
        self._watch = watch
        self._before_wait = before_wait
        self._where_now = where_now
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
        if self._work is not None and self._before_wait is not None \
                and not self._work.is_completed():  # a completed op cannot block
            self._before_wait()  # may wait on this very op (the check posted ahead)
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
        watch = None if isinstance(self._work, WorkList) else self._watch
        if watch is None:
            self._wait_for(None)
            return
        stall, group, n = watch
        waited, seconds = 0.0, stall.next_wait(0.0)
        try:
            while not self._wait_for(seconds):
                waited += seconds
                stall.stalled(group, n)  # raises where the ranks wait on each other
                seconds = stall.next_wait(waited)
        except CollectiveError:
            stall.failed()  # a rank that found a deadlock left (and closed its groups)?
            raise
        finally:
            if waited:  # ended, failed or raised: the report goes
                stall.resumed()

    def _wait_for(self, seconds: float | None) -> bool:
        """Wait for the op, at most ``seconds`` (None: until it ends); False if it is still
        in flight then (gloo's timed wait leaves it so). A failed op raises, named."""
        work = self._work
        assert work is not None
        try:
            if seconds is not None:
                try:
                    work.wait(timedelta(seconds=seconds))
                    return True
                except RuntimeError:
                    if not work.is_completed():
                        return False
            work.wait()  # (ended as the timed wait gave up: its own outcome)
            return True
        except RuntimeError:
            if self._describe is None:
                raise
            self._forget()  # a failed op is done; then say which one it was
            op, group, issued = self._describe
            now = issued if self._where_now is None else self._where_now()
            with failure_named(op, group, waited_where(now, issued)):
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

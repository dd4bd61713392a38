"""The end of an engine's life: what ``Engine.close()``, ``with engine:`` and the exit hook
release, so that a job that finished its work exits 0 (see docs/lifecycle.md).

An engine holds three kinds of things the interpreter's shutdown must not meet still busy:

- collectives in flight (``CommStats.pending``): gloo runs them on its own C++ worker
  threads, which must not be left working on (or holding the last reference to) Python
  objects while the interpreter finalizes;
- Python worker threads: the host tier's unit stepper and the NVMe tier's reader and
  writer pools (``ZeroModelState.close`` joins them);
- this rank's NVMe files (removed by ``ZeroModelState.close``).

``close(block=True)`` (an explicit ``engine.close()``, or leaving ``with engine:`` normally)
waits for every collective still in flight: the other ranks issued the same ones, so call
it on every rank. ``close(block=False)`` (leaving ``with engine:`` on an exception, and the
exit hook) never waits on communication, because after an error a peer may never join: it
releases the collectives that have completed and leaves the others (their count is logged).
The exit hook runs from :mod:`atexit`, before the interpreter starts finalizing, for an
engine that is still alive and was not closed.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable

from meshzero.comm import CommStats

logger = logging.getLogger(__name__)


class Lifecycle:
    """Closes one engine's communication and ZeRO state once: explicitly or at exit."""

    def __init__(self, comm_stats: CommStats, close_state: Callable[[], None]):
        """``close_state``: joins the engine's worker threads and removes its files
        (``ZeroModelState.close``)."""
        self.comm_stats = comm_stats
        self.close_state = close_state
        self.closed = False
        ref = weakref.ref(self)

        def at_exit() -> None:  # only a weak reference: the hook keeps no engine alive
            lifecycle = ref()
            if lifecycle is not None:
                lifecycle.close(block=False)

        self._at_exit = at_exit
        atexit.register(at_exit)

    def close(self, block: bool = True) -> None:
        """Wait for (``block``) or release every collective in flight, then join threads
        and remove files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        try:
            left = self.comm_stats.finish_pending(block=block)
        finally:
            self.close_state()
        if left:
            logger.warning("closed with %d collective(s) still in flight (a rank failed or "
                           "a collective was never matched); they were not waited on", left)

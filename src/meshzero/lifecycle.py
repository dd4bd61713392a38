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
The exit hook is a :func:`weakref.finalize` on the engine: it runs when the engine is
garbage-collected, or (if it is still alive then) from :mod:`atexit`, before the
interpreter starts finalizing.

The process group itself is torch's: ``dist.destroy_process_group()`` frees it, and with
it gloo's threads, once nothing else holds it. ``init_distributed`` imports
``torch._dynamo`` before creating it, because that import (done by the first
``torch.optim`` optimizer) otherwise keeps the WORLD group alive for good.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

from meshzero.comm import CommStats

logger = logging.getLogger(__name__)


class Lifecycle:
    """Closes one engine's communication and ZeRO state once: explicitly, when the engine
    is garbage-collected, or at exit."""

    def __init__(self, owner: object, comm_stats: CommStats, close_state: Callable[[], None]):
        """``owner``: the engine (only weakly referenced); ``close_state``: joins its worker
        threads, removes its files and hooks (``ZeroModelState.close``)."""
        self.comm_stats = comm_stats
        self.close_state = close_state
        self.closed = False
        # runs close(block=False) when the owner is collected, or from atexit if it is
        # still alive then (weakref.finalize's own exit hook), never both
        self._finalizer = weakref.finalize(owner, self.close, False)

    def close(self, block: bool = True) -> None:
        """Wait for (``block``) or release every collective in flight, then join threads
        and remove files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        try:
            left = self.comm_stats.finish_pending(block=block)
        finally:
            self.close_state()
        if left:
            logger.warning("closed with %d collective(s) still in flight (a rank failed or "
                           "a collective was never matched); they were not waited on", left)

"""The stall watch: ranks that wait on each other's collectives find out, and say so.

The training path posts nothing for it. A rank's wait on a gloo collective is made in slices
(``Handle``, comm/handle.py); after the first second without completion the rank publishes a
report in the job's key-value store (the one the process group was made with)::

    {"row": [phase code, step], "at": [group, n], "in": [ranks of group], "issued":
     {group: ops issued}}

(``at``: it waits on its ``n``-th op over ``group``; ``issued``: how many ops it has issued
over each group, frozen while it waits) and reads the reports of the other ranks of its
check group. Rank A waits for rank B when A waits on op ``n`` over a group B belongs to and
B has issued fewer than ``n`` ops over it. A cycle of such waits that this rank waits into
is a deadlock, whatever comes later: each rank of the cycle waits for a collective that the
next will issue only once its own wait ends. So every rank of it raises PhaseError naming
the two sides ("save_checkpoint was called on rank 0 while rank 1 is in backward (step 3);
call it on every rank") within seconds, instead of each waiting for ``faults.comm_timeout``.

A report may be out of date (its rank resumed and has not withdrawn it yet), but never all
the reports of a cycle: for A's wait to have ended, B must have issued the op A waited on,
which B does only after its own wait ends, which needs A to issue what B waited on, which A
does only after its wait ended. A rank that is only slow (evaluating, loading data) waits
in no collective and publishes nothing, so it closes no cycle: the others keep waiting.

Only gloo waits are made in slices (``Work.wait(timeout)`` there leaves the op in flight),
and not gloo's point-to-point ones (a timed-out wait closes their connection): those are
stage 3's gathers, each issued after a unit-order check on the control group, and the
parameter all-gather after a step, after the step's watched sum. With another backend
(NCCL) the host does not block in a collective's wait, so the engine posts its phase ahead
instead (faults/phase.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence

import torch.distributed as dist

logger = logging.getLogger("meshzero")

FIRST_SECONDS = 1.0  # a wait this long is reported; the ones after it, every LATER_SECONDS
LATER_SECONDS = 0.5
# the slices grow with the wait, to 8 s (a rank waiting for a slow peer reads less), more
# with more ranks to read: every stalled rank reads every report of its group each slice
MOST_SECONDS, MOST_SECONDS_AT_SCALE, RANKS_PER_READ = 8.0, 60.0, 64

Report = dict  # {"row": [...], "at": [group, n], "in": [ranks], "issued": {group: n}}


def default_store() -> dist.Store | None:
    """The store the default process group was made with (None where torch has no such
    accessor: the watch is then off and the engine posts ahead)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return None if get is None else get()
    except (RuntimeError, ValueError):
        return None


def deadlocked(me: int, reports: dict[int, Report]) -> list[int]:
    """The ranks of a cycle of waits that rank ``me`` waits into ([] if none), from the
    reports of the ranks that are waiting now."""
    def waits_for(a: int) -> list[int]:
        group, n = reports[a]["at"]
        return [b for b in reports[a]["in"]
                if b != a and b in reports and reports[b]["issued"].get(group, 0) < n]

    path: list[int] = []
    seen: set[int] = set()

    def visit(a: int) -> list[int]:
        if a in path:
            return path[path.index(a):]
        if a in seen:
            return []
        seen.add(a)
        path.append(a)
        for b in waits_for(a):
            cycle = visit(b)
            if cycle:
                return cycle
        path.pop()
        return []

    return visit(me) if me in reports else []


class StallWatch:
    """Reports this rank's stalled waits and raises where they are a deadlock.

    ``ranks``: the global ranks whose reports are read (the check group's); ``row()``: this
    rank's phase row, ``[phase code, step]``; ``issued``: ops issued per group, and
    ``members``: each group's global ranks (CommStats keeps both); ``error(rows)``: the
    exception for a cycle whose ranks' rows are ``{rank: row}``."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, ranks: Sequence[int],
                 row: Callable[[], list[int]], issued: dict[str, int],
                 members: dict[str, list[int]],
                 error: Callable[[dict[int, list[int]]], Exception]):
        self.store, self.prefix, self.rank = store, prefix, rank
        self.ranks = list(ranks)
        self.row, self.issued, self.members, self.error = row, issued, members, error
        self.reported = False
        self.on = True  # False once the store failed: waits go on unwatched

    def next_wait(self, waited: float) -> float:
        """Seconds of the next slice of a wait that has lasted ``waited`` so far."""
        most = min(MOST_SECONDS_AT_SCALE,
                   MOST_SECONDS * max(1.0, len(self.ranks) / RANKS_PER_READ))
        return FIRST_SECONDS if waited == 0 else min(most, max(LATER_SECONDS, waited / 4))

    def stalled(self, group: str, n: int) -> None:
        """The wait on this rank's ``n``-th op over ``group`` has not completed: report it
        (once per wait) and raise where the waits close a cycle."""
        if not self.on:
            return
        try:
            rows = self._found()  # another rank of a cycle saw it first
            if rows is None:
                rows = self._look(group, n)
        except (RuntimeError, ValueError, KeyError) as exc:  # the store is gone: no watch
            logger.debug("stall watch off: %s", exc)
            self.on = False
            return
        if rows is not None:
            self.resumed()
            raise self.error(rows)

    def failed(self) -> None:
        """A wait failed: raise the deadlock's error where a rank of the group found one (it
        left, and its groups closed under this rank's wait)."""
        try:  # (a rank whose wait had not yet stalled can still be failing into one)
            rows = self._found() if self.on else None
        except (RuntimeError, ValueError) as exc:
            logger.debug("stall watch off: %s", exc)
            rows, self.on = None, False
        if rows is not None:
            self.resumed()
            raise self.error(rows)

    def _look(self, group: str, n: int) -> dict[int, list[int]] | None:
        """Report this wait (once) and read the others': the rows of a cycle, if any; it is
        left in the store for the cycle's other ranks, whose waits may fail before they
        look again (the first rank to see it leaves, and its groups close)."""
        if not self.reported:
            mine = {"row": self.row(), "at": [group, n], "in": self.members[group],
                    "issued": self.issued}
            self.store.set(self._key(self.rank), json.dumps(mine))
            self.reported = True
        reports = self._read()
        if not deadlocked(self.rank, reports):
            return None
        # the cycle's ranks and every rank waiting into it: all of them stay stuck
        stuck = [r for r in sorted(reports) if deadlocked(r, reports)]
        rows = {r: reports[r]["row"] for r in stuck}
        self.store.set(self._key("deadlock"), json.dumps(rows))
        return rows

    def _found(self) -> dict[int, list[int]] | None:
        """The rows of a deadlock another rank of the group found, with this rank's own:
        this rank's wait stalled or failed after it (its ranks leave, closing their
        groups), so it waits into it."""
        key = self._key("deadlock")
        if not self.store.check([key]):
            return None
        rows = {int(r): row for r, row in json.loads(self.store.get(key)).items()}
        rows.setdefault(self.rank, self.row())
        return dict(sorted(rows.items()))

    def resumed(self) -> None:
        """The wait that was reported ended: withdraw the report."""
        if self.reported and self.on:
            self.reported = False
            try:
                self.store.set(self._key(self.rank), "")
            except (RuntimeError, ValueError) as exc:
                logger.debug("stall watch off: %s", exc)
                self.on = False

    def close(self) -> None:
        if self.on:
            with contextlib.suppress(RuntimeError, ValueError):
                self.store.delete_key(self._key(self.rank))
        self.on = False

    def _key(self, rank: int | str) -> str:
        return f"{self.prefix}/{rank}"

    def _read(self) -> dict[int, Report]:
        """The current reports of the watched ranks (a rank not waiting has none)."""
        keys = [self._key(r) for r in self.ranks]
        if self.store.check(keys):
            values = dict(zip(self.ranks, self.store.multi_get(keys), strict=True))
        else:  # a rank that never stalled has no key (get would block on it)
            values = {r: self.store.get(k) for r, k in zip(self.ranks, keys, strict=True)
                      if self.store.check([k])}
        return {r: json.loads(v) for r, v in values.items() if v}

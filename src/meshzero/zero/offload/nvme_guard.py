"""NVMe I/O faults that cannot mis-step or hang: lost data is recorded, every rank agrees on
it, and the step is refused on all ranks until a new backward rewrites the gradients.

A failed gradient write (``ENOSPC`` on the drive, say) happens on a writer thread during
backward. Raising it there, on one rank, would leave the other ranks waiting in the next
reduce-scatter; raising it in ``step()`` once per queued write would make a retried
``step()`` apply whatever the gradient file held. Instead :class:`IOFaults` records that the
data is lost (the first error: file and errno), and ``step()`` begins with
:func:`agree_failures`: one all-gather of a flag per rank over the whole job, counted as
``step_check`` (apart from the ZeRO data collectives), before any other collective of the
step. If any rank lost data, every rank refuses with the same message and keeps refusing
until a new backward has produced the gradients again.

The same agreement guards the generation commit of the tiled step and the reads and
write-backs of ``materialized()`` (checkpoints, ``full_state_dict``): an I/O error on one
rank raises on every rank there too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshzero.comm import Communicator
from meshzero.zero.offload.nvme_io import NvmeIOError

if TYPE_CHECKING:
    from meshzero.comm import CommStats

logger = logging.getLogger(__name__)

CHECK_OP = "step_check"  # the comm_report op of the agreement collectives
MESSAGE_BYTES = 1024  # each rank's error text in the second all-gather (only on a failure)


def world_communicator(stats: CommStats) -> Communicator:
    """Every rank of the job (tp and pp included: each of them calls ``step()``), counted in
    ``stats``; a one-rank group without a process group."""
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return Communicator(group, "world", stats)


def agree_failures(comm: Communicator, error: str | None,
                   device: torch.device) -> list[tuple[int, str]]:
    """``[(rank, message)]`` of every rank whose ``error`` is set, the same list on every rank
    of ``comm`` (call it on all of them): one all-gather of a flag, and a second of the
    messages only when some flag is set."""
    if comm.size == 1:
        return [] if error is None else [(0, error)]
    flags = torch.zeros(comm.size, dtype=torch.int32, device=device)
    mine = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    comm.all_gather(flags, mine, op=CHECK_OP).wait()
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return []
    raw = (error or "").encode("utf-8", "replace")[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
    texts = torch.empty(comm.size * MESSAGE_BYTES, dtype=torch.uint8, device=device)
    comm.all_gather(texts, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device),
                    op=CHECK_OP).wait()
    rows = texts.cpu().view(comm.size, MESSAGE_BYTES)
    return [(r, bytes(rows[r].tolist()).rstrip(b"\0").decode("utf-8", "replace"))
            for r in failed]


def describe_failures(failures: list[tuple[int, str]]) -> str:
    """``on rank 1: <error>`` (and how many other ranks failed)."""
    rank, message = failures[0]
    more = len(failures) - 1
    return f"on rank {rank}: {message}" + (f" (and {more} other rank(s))" if more else "")


class IOFaults:
    """The data this rank's NVMe I/O lost since the last agreement, and the refusal of the
    step that agreement led to (the same on every rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # writes fail on the writer thread
        self.lost: str | None = None  # the first lost-data error, not yet agreed on
        self.refused: str | None = None  # step() raises this until a new backward

    def run(self, fn: Callable[..., None], *args) -> bool:
        """``fn(*args)``; an NvmeIOError is recorded as lost data (False), never raised."""
        try:
            fn(*args)
        except NvmeIOError as exc:
            self.record(exc)
            return False
        return True

    def record(self, exc: NvmeIOError) -> None:
        """``exc`` lost data: the next step is refused on every rank."""
        with self._lock:
            first, self.lost = self.lost is None, self.lost or str(exc)
        if first:  # one line, not one per queued write
            logger.error("%s: the data is lost; step() will refuse on every rank until a new "
                         "backward", exc)

    def agree(self, comm: Communicator, device: torch.device) -> bool:
        """Whether any rank lost data (collective: every rank calls it at the start of the
        step); if so the step is refused on every rank, with the first rank's error."""
        with self._lock:
            lost, self.lost = self.lost, None
        failures = agree_failures(comm, lost, device)
        if not failures:
            return False
        self.refused = (
            f"NVMe offload lost data of this step {describe_failures(failures)}. step() is "
            "refused on every rank and no weight changed: free space on the NVMe drive (or "
            "fix the file), then run forward and backward again (the whole accumulation "
            "window) and call step(); step() refuses until a new backward")
        return True

    def new_backward(self) -> None:
        """A backward is producing the gradients again: the refusal ends."""
        self.refused = None

    def refuse(self) -> None:
        """Raise the refusal, if the step is refused (no collective: every rank agreed)."""
        if self.refused is not None:
            raise NvmeIOError(self.refused)


def raise_agreed(comm: Communicator, device: torch.device, error: Exception | None,
                 what: str) -> None:
    """Raise on every rank of ``comm`` if ``error`` is set on any (collective); ``what``
    says what was and was not done, e.g. "the optimizer step was not applied on any rank"."""
    failures = agree_failures(comm, None if error is None else str(error), device)
    if not failures:
        return
    if error is not None:
        raise NvmeIOError(f"{error}; {what}")
    raise NvmeIOError(f"NVMe offload I/O failed on another rank ({describe_failures(failures)})"
                      f"; {what}")

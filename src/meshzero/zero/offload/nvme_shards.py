"""Stage-3 parameter shards read from the NVMe files ahead of their all-gather
(``offload_param: nvme``), ``param_buffer_count`` units ahead in the recorded order, each
into a page-locked staging buffer of the tier's transfers that goes back to the pool once
the shard is on the device."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.nvme_io import NvmeIOError

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup
    from meshzero.zero.offload.nvme_store import NvmeStore


class ShardReads:
    """The shard reads of one :class:`NvmeStore`, on its reader thread."""

    def __init__(self, store: NvmeStore) -> None:
        self.store = store
        self._reads: dict[int, Future] = {}

    def read_now(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s shard of the current generation, read here."""
        store = self.store
        host = store.transfers.staging.take(g.layout.shard_numel, store.compute_dtype)
        what = f"parameter shard of {g.layout.slots[0].name}"
        if g.trainable:
            store.file("params", store.gen).read(g.space_offset, host, what)
        else:
            store.frozen_file.read(store.frozen_offset[id(g)], host, what)
        return host

    def prefetch_shard(self, g: FlatGroup) -> bool:
        """Start reading ``g``'s shard; False when ``param_buffer_count`` reads are out."""
        if id(g) in self._reads:
            return True
        if len(self._reads) >= self.store.options.param_buffer_count:
            return False
        self._reads[id(g)] = self.store.reader.submit(self.read_now, g)
        return True

    def drop(self) -> None:
        """Forget reads ahead (a step is about to change the shards)."""
        reads, self._reads = self._reads, {}
        for fut in reads.values():
            if fut.exception() is None:
                self.release_shard(fut.result())

    def release_shard(self, host: torch.Tensor) -> None:
        """A shard :meth:`read_shard` gave is on the device now: its buffer is reused."""
        self.store.transfers.staging.give(host)

    def read_shard(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s shard for its all-gather. A failed read must not keep this rank out of
        the all-gather the others are in: the shard is NaN (every rank's output shows it)
        and the data recorded as lost, so the step is refused on every rank."""
        fut = self._reads.pop(id(g), None)
        if fut is not None and fut.exception() is None:
            return fut.result()
        try:  # a read ahead that failed (perhaps before the fault was fixed) is tried again
            return self.read_now(g)
        except NvmeIOError as exc:
            self.store.faults.record(exc)
            return torch.full((g.layout.shard_numel,), float("nan"),
                              dtype=self.store.compute_dtype)

"""Where each rank's values of each parameter live in its flat buffers, for code that reads
or writes them by name and element range (checkpoints, weight files)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from meshzero.zero.flat_buffer import FlatGroup


def fragment_views(groups: Iterable[FlatGroup], *, for_load: bool
                   ) -> Iterator[tuple[torch.Tensor, str, int, int]]:
    """``(flat view, name, start, end)`` for every fragment whose values this rank saves
    (its owned range) or loads (the owned range; for resident frozen groups the whole
    buffer, which no all-gather refills). Trainable groups: views of the fp32 master."""
    for group in groups:
        lo, hi = group.owned
        if group.trainable:
            assert group.master is not None  # a trainable group holds its master shard
            target = group.master
        elif group.sharded:  # frozen, stage 3: the shard is the owned range
            target = group.shard
        elif for_load:
            lo, hi = 0, group.layout.padded_numel
            target = group.full
        else:
            target = group.full[lo:hi]
        for frag in group.layout.fragments(lo, hi):
            a = frag.local_offset
            yield target[a:a + frag.numel], frag.slot.name, frag.start, frag.end

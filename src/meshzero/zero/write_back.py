"""Writes into gathered parameters: what one rank wrote reaches every rank's state.

``engine.gathered(params, modifier_rank=r)`` lets rank ``r`` write new values into full
parameters (a custom init, rows copied into a resized embedding, weights loaded by hand).
On exit those values must reach everything that holds the parameter on every rank, or the
next step overwrites them from the fp32 master:

    rank r     the parameters' values (whatever ``p.data`` is now, same shape), in fp32,
               concatenated in slot order: one broadcast over the ZeRO group (and, with
               MiCS, one more over the replica group)
    every rank for each parameter's slot in its flat group:
                 fp32 master   the part inside this rank's owned range (the optimizer's
                               fragment leaves view it, so they see it too)
                 compute       stages 0-2 and persistent groups: the whole slot of the
                               resident full buffer; stage 3: the part inside the shard,
                               and the whole slot of the full buffer while it is gathered
               and ``p.data`` points at its slot of the full buffer again

DeepSpeed broadcasts the modifier's full parameters and re-partitions them
(``GatheredParameters.__exit__`` in deepspeed/runtime/zero/partition_parameters.py); its
fp32 partitions are not touched. Here the master is written too, so training continues
from the written values at every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshzero.comm import Communicator
from meshzero.zero.flat_buffer import FlatGroup
from meshzero.zero.units import ParamSlot


@dataclass(frozen=True)
class Target:
    """One parameter to write back: the tensor, its slot and its flat group."""

    param: torch.Tensor
    slot: ParamSlot
    group: FlatGroup


def global_rank(comm: Communicator | None, rank: int) -> int:
    """The global rank of ``comm``'s group rank ``rank`` (itself without a group)."""
    if comm is None or comm.group is None or not dist.is_initialized():
        return rank
    return dist.get_global_rank(comm.group, rank)


def check_modifier_rank(modifier_rank: int, size: int) -> None:
    if not isinstance(modifier_rank, int) or isinstance(modifier_rank, bool) \
            or not 0 <= modifier_rank < size:
        raise ValueError(f"modifier_rank={modifier_rank!r}: must be a data-parallel rank, "
                         f"an int in [0, {size}), or None (read-only)")


def _shape_error(target: Target, modifier_rank: int) -> str:
    return (f"parameter {target.slot.name!r} (shape {target.slot.shape}) changed shape on "
            f"the modifier rank {modifier_rank} inside the gathered block: a gathered write "
            "may change values, not shapes (resize the model before meshzero.initialize, "
            "e.g. inside meshzero.zero_init)")


def _modifier_values(targets: Sequence[Target], device: torch.device
                     ) -> tuple[torch.Tensor | None, int]:
    """The modifier's values, fp32 and flat in target order; or the index of a target
    whose shape changed (-1: none)."""
    for i, t in enumerate(targets):
        if tuple(t.param.shape) != t.slot.shape:
            return None, i
    with torch.no_grad():
        parts = [t.param.detach().reshape(-1).to(device, torch.float32) for t in targets]
    return torch.cat(parts) if parts else torch.empty(0, device=device), -1


def broadcast_values(targets: Sequence[Target], *, comm: Communicator,
                     replica_comm: Communicator | None, modifier_rank: int,
                     device: torch.device) -> torch.Tensor:
    """Rank ``modifier_rank``'s values of ``targets`` (fp32, flat) on every rank.

    ``modifier_rank``: the rank in the data-parallel group (ZeRO group rank + its size times
    the replica rank, with MiCS). A shape change on the modifier raises on every rank."""
    size = comm.size * (replica_comm.size if replica_comm is not None else 1)
    check_modifier_rank(modifier_rank, size)
    shard_src, replica_src = modifier_rank % comm.size, modifier_rank // comm.size
    mine = comm.rank == shard_src and (replica_comm is None or replica_comm.rank == replica_src)
    values, bad = _modifier_values(targets, device) if mine else (None, -1)
    status = torch.tensor([bad], dtype=torch.int64, device=device)
    hops = [(c, src) for c, src in ((comm, shard_src), (replica_comm, replica_src))
            if c is not None and c.size > 1]
    for c, src in hops:
        c.broadcast(status, global_rank(c, src)).wait()
    if int(status.item()) >= 0:
        raise ValueError(_shape_error(targets[int(status.item())], modifier_rank))
    if values is None:
        values = torch.empty(sum(t.slot.numel for t in targets), dtype=torch.float32,
                             device=device)
    for c, src in hops:
        c.broadcast(values, global_rank(c, src)).wait()
    return values


def write_values(targets: Sequence[Target], values: torch.Tensor) -> None:
    """Write each target's slice of ``values`` (fp32, flat in target order) into its
    group's master, shard and full buffer on this rank, and rebind ``p.data``."""
    at = 0
    with torch.no_grad():
        for t in targets:
            value = values[at:at + t.slot.numel]
            at += t.slot.numel
            _write_one(t, value)


def _write_one(t: Target, value: torch.Tensor) -> None:
    group, slot = t.group, t.slot
    lo, hi = group.owned
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
    part = value[a - slot.offset:b - slot.offset]
    master = group.master
    if a < b and master is not None and master.untyped_storage().nbytes() > 0:
        master[a - lo:b - lo].copy_(part)
    if group.sharded:
        if a < b:
            group.shard[a - lo:b - lo].copy_(part)
        if group.is_full_allocated():  # gathered now: what the block's readers see
            group.full[slot.offset:slot.offset + slot.numel].copy_(value)
    else:  # resident on every rank: the whole slot, no all-gather needed
        group.full[slot.offset:slot.offset + slot.numel].copy_(value)
    if group.sharded and not group.is_full_allocated():
        return  # released (a write outside a gathered block): p.data is its view already
    view = group.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
    param = t.param
    if param.data.data_ptr() != view.data_ptr() or param.data.dtype != view.dtype:
        param.data = view  # the block replaced p.data: point it at its slot again

"""What a rank's ZeRO state reads out without changing it: the elements it holds at rest,
and the full fp32 values of every flat group (gathered where sharded) and state-dict entry.
A mixin of :class:`meshzero.zero.state.ZeroModelState`."""

from __future__ import annotations

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.zero.flat_buffer import FlatGroup


class StateReads:
    """Reads over ``groups`` (this rank's flat groups), ``comm`` (the shard group) and
    ``model``, which the state sets."""

    groups: list[FlatGroup]
    comm: Communicator
    model: nn.Module

    def held_numel(self) -> int:
        """Parameter elements this rank holds at rest (padding included)."""
        return sum(g.layout.shard_numel if g.sharded else g.layout.padded_numel
                   for g in self.groups)

    def held_numel_by_param(self) -> dict[int, int]:
        """id(param) -> elements of it this rank holds at rest (no padding)."""
        held = {}
        for g in self.groups:
            lo, hi = g.layout.shard_range(self.comm.rank) if g.sharded else (0, g.layout.numel)
            for slot, p in zip(g.layout.slots, g.params, strict=True):
                held[id(p)] = max(0, min(hi, slot.offset + slot.numel) - max(lo, slot.offset))
        return held

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: full fp32 CPU tensor}`` for every entry of ``model.state_dict()``, on
        every rank (tied parameters appear under each of their names)."""
        flat_of = {id(p): (g, s) for g in self.groups for s, p in zip(g.layout.slots, g.params,
                                                                        strict=True)}
        cache: dict[int, torch.Tensor] = {}
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in flat_of:
                group, slot = flat_of[id(t)]
                if id(group) not in cache:
                    cache[id(group)] = self.full_fp32(group)
                flat = cache[id(group)]
                out[name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            else:
                value = t.detach().cpu()
                out[name] = value.float() if value.is_floating_point() else value.clone()
        return out

    def full_fp32(self, group: FlatGroup) -> torch.Tensor:
        """The whole flat buffer of ``group`` in fp32 on the CPU (collective at stages 1-3)."""
        with torch.no_grad():
            if group.trainable:
                assert group.master is not None  # a trainable group holds its master shard
                local = group.master
                if group.owned == (0, group.layout.padded_numel):
                    return local.detach().float().cpu()
            elif not group.sharded:
                return group.full.detach().float().cpu()
            else:
                local = group.shard
            full = torch.empty(group.layout.padded_numel, dtype=local.dtype, device=local.device)
            self.comm.all_gather(full, local.detach().contiguous()).wait()
            return full.float().cpu()

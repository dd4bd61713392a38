"""The ZeRO model state of one rank: units, flat groups, hooks, and what they hold.

Stages compose rather than copy each other (DESIGN.md section 3):

    stage 0  full params, full grads (all-reduced), full optimizer state
    stage 1  + master and optimizer state only for this rank's shard
    stage 2  + gradients reduce-scattered during backward into the shard
    stage 3  + parameters at rest are only the shard (ParameterSharder)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.zero.flat_buffer import FlatGroup
from meshzero.zero.reducer import GradientReducer
from meshzero.zero.sharded_optimizer import ShardedOptimizerState
from meshzero.zero.sharded_params import GatheredMemory, ParameterSharder
from meshzero.zero.units import Layout, build_layout

TIERS = ("device", "host", "nvme")
CATEGORIES = ("params", "master_params", "grads", "optimizer_states")


@dataclass(frozen=True)
class ZeroOptions:
    stage: int
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    unit_classes: list[str] | None
    persistence_threshold: int
    reduce_bucket_numel: int
    allgather_bucket_numel: int
    prefetch_numel: int
    max_live_numel: int
    max_reuse_distance: int


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ZeroModelState:
    def __init__(self, model: nn.Module, comm: Communicator, device: torch.device,
                 options: ZeroOptions):
        self.model = model
        self.comm = comm
        self.device = device
        self.options = options
        stage = options.stage
        self.layout: Layout = build_layout(
            model,
            num_shards=comm.size,
            unit_classes=options.unit_classes,
            persistence_threshold=options.persistence_threshold if stage == 3 else None,
        )
        named = dict(model.named_parameters())
        self.units: list[list[FlatGroup]] = [
            [
                FlatGroup(g, [named[s.name] for s in g.slots], stage=stage, rank=comm.rank,
                          compute_dtype=options.compute_dtype, device=device)
                for g in unit.groups
            ]
            for unit in self.layout.units
        ]
        self.groups = [g for gs in self.units for g in gs]
        resident = sum(g.full_nbytes for g in self.groups if not g.sharded)
        self.memory = GatheredMemory(resident)
        self.sharder: ParameterSharder | None = None
        if stage == 3:
            self.sharder = ParameterSharder(
                [model.get_submodule(u.path) for u in self.layout.units], self.units, comm,
                self.memory, prefetch_numel=options.prefetch_numel,
                max_live_numel=options.max_live_numel,
                max_reuse_distance=options.max_reuse_distance,
            )
        self.reducer = GradientReducer(
            self.units, comm, stage=stage, comm_dtype=options.comm_dtype,
            bucket_numel=options.reduce_bucket_numel, on_unit_ready=self._on_unit_ready,
        )
        self.optim_state = ShardedOptimizerState(
            self.groups, comm, stage=stage, allgather_bucket_numel=options.allgather_bucket_numel)

    def _on_unit_ready(self, unit: int) -> None:
        """All grads of ``unit`` are in: at stage 3 its full params can go (unless frozen
        sharded params may still be needed by backward; those go at the end of backward)."""
        if self.sharder is not None and all(g.trainable for g in self.units[unit] if g.sharded):
            self.sharder.release_parameters(unit)

    # -- step hooks used by the engine -----------------------------------------------------------
    def start_forward(self) -> None:
        if self.sharder is not None:
            self.sharder.start_forward()

    def start_backward(self, boundary: bool) -> None:
        self.reducer.begin_backward(boundary)
        if self.sharder is not None:
            self.sharder.start_backward()

    def finish_backward(self) -> None:
        self.reducer.finish_backward()
        if self.sharder is not None:
            self.sharder.end_backward()

    def zero_grads(self) -> None:
        self.optim_state.zero_grads()
        self.reducer.grads_are_zero = True

    # -- reports ------------------------------------------------------------------------------
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

    def _tier(self, t: torch.Tensor) -> str:
        return "device" if t.device == self.device else "host"

    def memory_report(self, optimizer: torch.optim.Optimizer) -> dict:
        """Bytes this rank holds at rest, by category and tier, from the buffers it owns."""
        report: dict = {c: dict.fromkeys(TIERS, 0) for c in CATEGORIES}

        def add(category: str, t: torch.Tensor | None) -> None:
            if t is not None:
                report[category][self._tier(t)] += _nbytes(t)

        for g in self.groups:
            add("params", g.shard if g.sharded else g.full)
            if g.trainable and g.master_is_copy:
                add("master_params", g.master)
            if g.trainable:
                add("grads", g.grad_full if g.stage <= 1 else g.grad)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer_states", value)
        report["gathered_params_peak"] = self.memory.peak
        return report

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

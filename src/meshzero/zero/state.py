"""The ZeRO model state of one rank: units, flat groups, hooks, and what they hold.

Stages compose rather than copy each other (DESIGN.md section 3):

    stage 0  full params, full grads (all-reduced), full optimizer state
    stage 1  + master and optimizer state only for this rank's shard
    stage 2  + gradients reduce-scattered during backward into the shard
    stage 3  + parameters at rest are only the shard (ParameterSharder)
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.zero.flat_buffer import FlatGroup
from meshzero.zero.nvme import NvmeStore
from meshzero.zero.offload import (
    OffloadOptions,
    UnitStepper,
    check_nvme_path,
    step_subset,
    subsets_by_group,
)
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
    offload: OffloadOptions = field(default_factory=OffloadOptions)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ZeroModelState:
    def __init__(self, model: nn.Module, comm: Communicator, device: torch.device,
                 options: ZeroOptions,
                 materialize: Callable[[Layout], Iterable[int]] | None = None,
                 secondary_comm: Communicator | None = None,
                 replica_comm: Communicator | None = None):
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
        self.offload = offload = options.offload
        # NVMe: where each trainable group's owned range sits in the optimizer space, so its
        # master can go to its file as soon as the group is built
        space, offsets = 0, {}
        for u, unit in enumerate(self.layout.units):
            for i, g in enumerate(unit.groups):
                if g.requires_grad:
                    offsets[(u, i)] = space
                    space += g.shard_numel
        self.nvme: NvmeStore | None = None
        if offload.optimizer == "nvme":
            self._check_nvme_space(space)
            self.nvme = NvmeStore(comm, offload, options.compute_dtype, space)
        # a meta-device model is made real unit by unit, each unit's groups built as soon as
        # it is complete (zero/materialize.py); otherwise the units in order
        ready = range(len(self.layout.units)) if materialize is None else materialize(
            self.layout)

        def sink(u: int, i: int):
            if self.nvme is None:
                return None
            return lambda master: self.nvme.write_master(offsets[(u, i)], master)

        built: dict[int, list[FlatGroup]] = {}
        for u in ready:
            built[u] = [
                FlatGroup(g, [model.get_parameter(s.name) for s in g.slots], stage=stage,
                          rank=comm.rank, compute_dtype=options.compute_dtype, device=device,
                          offload=offload, master_sink=sink(u, i))
                for i, g in enumerate(self.layout.units[u].groups)
            ]
        self.units: list[list[FlatGroup]] = [built[u] for u in range(len(self.layout.units))]
        self.groups = [g for gs in self.units for g in gs]
        resident = sum(g.full_nbytes for g in self.groups if not g.sharded)
        self.memory = GatheredMemory(resident)
        self.optim_state = ShardedOptimizerState(
            self.groups, comm, stage=stage, allgather_bucket_numel=options.allgather_bucket_numel,
            nvme_tile_numel=offload.sub_group_size if offload.optimizer == "nvme" else None)
        if self.nvme is not None:
            st = self.optim_state
            if st.space_numel != space:
                raise AssertionError(f"optimizer space {st.space_numel} != layout {space}")
            self.nvme.attach(self.groups, st.fragment_index, st.tiles, st.tile_of)
            for g in self.groups:
                if g.trainable:
                    g.grad_sink = self.nvme.take_grad
        self.sharder: ParameterSharder | None = None
        if stage == 3:
            self.sharder = ParameterSharder(
                [model.get_submodule(u.path) for u in self.layout.units], self.units, comm,
                self.memory, prefetch_numel=options.prefetch_numel,
                max_live_numel=options.max_live_numel,
                max_reuse_distance=options.max_reuse_distance,
                shard_source=self.nvme if offload.param == "nvme" else None,
                secondary_comm=secondary_comm,
            )
        self.reducer = GradientReducer(
            self.units, comm, stage=stage, comm_dtype=options.comm_dtype,
            bucket_numel=options.reduce_bucket_numel, on_unit_ready=self._on_unit_ready,
            on_unit_reduced=self._on_unit_reduced, replica_comm=replica_comm,
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepper = UnitStepper()
        self._step_scale: float | None = None
        self._unit_subsets: dict[int, list[list[torch.Tensor]]] = {}

    def _check_nvme_space(self, space: int) -> None:
        """The NVMe paths exist, are writable directories and have room for this node's
        ranks (upper bound: two generations of master, Adam's two states and the params, one
        gradient shard; ``space``: elements of this rank's optimizer space)."""
        itemsize = self.options.compute_dtype.itemsize
        frozen = sum(g.shard_numel for unit in self.layout.units for g in unit.groups
                     if not g.requires_grad and self.options.stage == 3 and not g.persistent)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        param_bytes = 2 * space * itemsize + (frozen * itemsize
                                              if self.offload.param == "nvme" else 0)
        optim_bytes = space * (2 * 4 + 4 + 2 * 8)
        paths = {self.offload.optimizer_nvme_path: ("offload_optimizer", optim_bytes)}
        if self.offload.param == "nvme" and \
                self.offload.param_nvme_path != self.offload.optimizer_nvme_path:
            paths[self.offload.param_nvme_path] = ("offload_param", param_bytes)
        else:
            paths[self.offload.optimizer_nvme_path] = ("offload_optimizer",
                                                      optim_bytes + param_bytes)
        for path, (key, nbytes) in paths.items():
            check_nvme_path(f"zero_optimization.{key}.nvme_path", path, nbytes * local)

    # -- the optimizer step (host and NVMe tiers) ------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        unit_of = {id(g): u for u, gs in enumerate(self.units) for g in gs}
        leaves = defaultdict(list)
        for leaf, _, g in self.optim_state.fragment_index:
            leaves[unit_of[id(g)]].append(leaf)
        self._unit_subsets = {u: subsets_by_group(optimizer, ls) for u, ls in leaves.items()}
        if self.nvme is not None:
            self.nvme.attach_optimizer(optimizer)

    def _on_unit_reduced(self, unit: int) -> None:
        scale = self._step_scale
        if scale is not None and unit in self._unit_subsets:
            self.stepper.submit(lambda: self._step_unit(unit, scale))

    def _step_unit(self, unit: int, scale: float) -> None:
        """Host tier, on the worker thread: step one unit's fragments and copy the result
        into its compute parameters while backward goes on."""
        with torch.no_grad():
            groups = [g for g in self.units[unit] if g.trainable]
            if scale != 1.0:
                for g in groups:
                    g.grad.mul_(scale)
            step_subset(self.optimizer, self._unit_subsets[unit])
            for g in groups:
                g.copy_master_to_params()

    def finish_unit_steps(self) -> bool:
        """Wait for the unit steps of the last backward; True if it stepped everything."""
        stepped = self._step_scale is not None
        self._step_scale = None
        self.stepper.wait()
        return stepped

    def optimizer_step(self, scale: float) -> None:
        """Scale the gradients by ``scale`` and step every fragment (not yet in params)."""
        if self.nvme is not None:
            self.nvme.step(self.optimizer, scale)
            return
        self.optim_state.scale_grads(scale)
        self.optim_state.attach_grads()
        self.optimizer.step()

    def materialized(self, write_back: bool = False):
        """A context in which every master, optimizer state and shard is in memory (the NVMe
        tier reads them in; ``write_back`` writes changes back)."""
        if self.nvme is None:
            return nullcontext()
        return self.nvme.materialized(self.optimizer, self.optim_state.fragment_index,
                                      write_back)

    @contextmanager
    def gradients_held(self) -> Iterator[None]:
        """Inside, gradients accumulate in ``param.grad`` over several backwards (a pipeline
        schedule's micro-batches) instead of being reduced after each; then call
        :meth:`reduce_held_gradients` once."""
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = True

    def reduce_held_gradients(self) -> None:
        """Reduce what accumulated in ``param.grad`` under :meth:`gradients_held`."""
        self.reducer.reduce_param_grads()

    def close(self) -> None:
        self.stepper.close()
        if self.nvme is not None:
            self.nvme.close()

    def _on_unit_ready(self, unit: int) -> None:
        """All grads of ``unit`` are in: at stage 3 its full params can go (unless frozen
        sharded params may still be needed by backward; those go at the end of backward)."""
        if self.sharder is not None and all(g.trainable for g in self.units[unit] if g.sharded):
            self.sharder.release_parameters(unit)

    # -- step hooks used by the engine -----------------------------------------------------------
    def start_forward(self) -> None:
        if self.sharder is not None:
            self.sharder.start_forward()

    def start_backward(self, boundary: bool, step_scale: float | None = None) -> None:
        """``step_scale``: on the boundary, step each unit (host tier) as soon as its
        gradient is reduced, with the gradient times ``step_scale``."""
        self._step_scale = step_scale if boundary else None
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

    def memory_report(self, optimizer: torch.optim.Optimizer) -> dict:
        """Bytes this rank holds at rest, by category and the tier each buffer lives in
        (placed by the offload config: the host tier is a separate copy even on a CPU-only
        machine), plus the NVMe tier's host tile buffers under ``offload_buffers``."""
        report: dict = {c: dict.fromkeys(TIERS, 0) for c in CATEGORIES}
        opt_tier, param_tier = self.offload.optimizer_tier, self.offload.param_tier
        for g in self.groups:
            if g.sharded:
                report["params"][param_tier] += _nbytes(g.shard)
            else:
                report["params"]["device"] += _nbytes(g.full)
            if not g.trainable:
                continue
            owned = (g.owned[1] - g.owned[0]) * 4
            if g.master_is_copy:
                report["master_params"][opt_tier] += owned
            if g.stage <= 1:
                report["grads"]["device"] += _nbytes(g.grad_full)
            if g.stage >= 2 or opt_tier != "device":
                report["grads"][opt_tier] += owned
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    report["optimizer_states"][opt_tier] += _nbytes(value)
        report["offload_buffers"] = {"device": 0, "host": 0 if self.nvme is None else
                                     self.nvme.buffer_nbytes, "nvme": 0}
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

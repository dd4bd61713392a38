"""Stage 3: parameters at rest are only this rank's shard; units are gathered around use.

Hooks per unit module:
    forward pre-hook   gather_parameters(unit) (waiting on a prefetch if one was issued),
                       then prefetch the next units of the recorded forward order
    forward post-hook  release_parameters(unit) (unless it is reused soon, see below) and
                       hook the outputs so the unit is gathered again before its backward
    output grad hook   gather_parameters(unit), prefetch the next units of the backward order
    grads ready        release_parameters(unit) (called by the GradientReducer)

Orders are recorded during the first step and are the same on every rank, so prefetch
all-gathers are issued in the same order everywhere. Releasing frees the storage of the
unit's full flat buffer; the parameter tensors (views of it) stay the same objects, so
tensors saved by autograd are refilled by the next gather.

Uses outside these hooks (zero/param_access.py) gather a unit on demand and make it *sticky*:
kept until the end of backward or the next step. So is a unit whose output views its own
parameters (a block returning its bias). A unit running inside itself (recursion) is released
only when its outermost call returns. Before every all-gather the ranks exchange the unit
index, so ranks that run different units (rank-dependent control flow) fail naming both. The
exchange runs over a process group of its own: on the data group it would queue behind the
gathers and reductions in flight (gloo runs a group's ops in order) and wait for them all.

ZeRO++ qwZ (``quantize``: "all" groups, or "frozen", those of parameters frozen at
initialize): the hooks' gathers (and a backward regather) move int8 blocks and scales
(Communicator.all_gather_quantized) and dequantize into the full buffer; the shard stays
exact. Gathers on demand (engine.gathered, a parameter read outside the hooks, a 16-bit save)
move exact values; hpZ's backward gathers move the forward's dequantized copy inside the node.

Reuse (zero/gather_plan.py): from the second step, the units of the plan's kept set are not
released after their last forward use; their backward finds them gathered.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from meshzero.comm import Communicator, Handle, all_gather_objects
from meshzero.faults.phase import PhaseCheck
from meshzero.zero.flat_buffer import FlatGroup, alloc_storage, free_storage
from meshzero.zero.gather_plan import plan_reuse
from meshzero.zero.param_access import (
    ParamInfo,
    SavedParameterHooks,
    ZeroParamStatus,
    forget_dead,
    mark_sharded,
    output_tensors,
    unmark_sharded,
)

# qwZ's block: int8 codes and one fp32 scale per 2048 elements (0.2 % more bytes than int8)
QWZ_BLOCK = 2048


class GatherOrderError(RuntimeError):
    """Stage 3: the ranks gathered different units at the same point of the step."""


def order_check_communicator(comm: Communicator,
                             timeout: timedelta | None = None) -> Communicator | None:
    """A communicator over ``comm``'s ranks on a gloo process group of its own (with
    ``timeout``, faults.comm_timeout) for the phase check and stage 3's unit-order check
    (counted as ``order_check`` under ``comm``'s name), on host tensors whatever ``comm``'s
    backend (faults/phase.py); None for one rank."""
    if comm.size == 1 or comm.group is None:
        return None
    # new_group is collective over the world, every rank naming the same ranks in the same
    # order: learn every rank's group first (a tp or MiCS mesh has several)
    mine = tuple(dist.get_process_group_ranks(comm.group))
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in all_gather_objects(mine, dist.group.WORLD):
        if tuple(ranks) not in groups:
            groups[tuple(ranks)] = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
    # a few bytes per rank: gloo's own all-gather (the point-to-point one is for data)
    return Communicator(groups[mine], comm.name, comm.stats, inter_node=comm.inter_node,
                        point_to_point=False)


class GatheredMemory:
    """Bytes of full parameter buffers alive now and their peak since the last reset."""

    def __init__(self, resident: int):
        self.resident = resident  # full buffers that never leave (stages 0-2, persistent)
        self.current = resident
        self.peak = resident

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current


class ParameterSharder:
    """Gathers and releases the sharded groups of every unit around its forward/backward."""

    def __init__(
        self,
        modules: list[nn.Module],
        units: list[list[FlatGroup]],
        comm: Communicator,
        memory: GatheredMemory,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        shard_source=None,
        secondary_comm: Communicator | None = None,
        unit_names: list[str] | None = None,
        phases: PhaseCheck | None = None,
        quantize: str = "none",
    ):
        """``shard_source``: with parameter offload, an object whose ``read_shard(group)``
        returns a group's shard from the NVMe tier and ``prefetch_shard(group)`` starts
        reading it (None: the shard is ``group.shard``, on the device or in host memory).
        ``secondary_comm`` (ZeRO++ hpZ): after forward each rank keeps 1/k of the unit, k the
        size of this group, and backward all-gathers over it (inside a node) instead of over
        every data-parallel rank. ``unit_names``: module paths, for error messages.
        ``phases``: the phase check the unit-order check rides on (None: no check).
        ``quantize``: qwZ's groups, "all", "frozen" or "none" (module docstring)."""
        self.units = [[g for g in gs if g.sharded] for gs in units]
        self.comm = comm
        self.memory = memory
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.shard_source = shard_source
        self.secondary_comm = secondary_comm
        self.quantize = quantize
        self.secondary: dict[int, list[torch.Tensor]] = {}
        self.device = next((g.full.device for gs in units for g in gs), torch.device("cpu"))
        self.numel = [sum(g.layout.padded_numel for g in gs) for gs in self.units]
        self.pending: dict[int, list[Handle]] = {}
        self.gathered = [False] * len(self.units)
        self.fwd_order: list[int] = []
        self.bwd_order: list[int] = []
        self.release_pos: dict[int, int] = {}  # unit -> fwd_pos at its last post-forward
        self.kept: frozenset[int] = frozenset()  # kept gathered into backward (the plan)
        self.phases = phases or PhaseCheck(None, comm.stats, self.device)
        self.recording = True
        self.in_backward = False
        self.fwd_pos = self.bwd_pos = 0
        self.unit_names = unit_names or [str(u) for u in range(len(self.units))]
        self.depth = [0] * len(self.units)  # calls of each unit in progress (recursion)
        self.sticky: set[int] = set()  # gathered until the end of backward or the step
        self._unit_of_storage: dict[int, int] = {}  # data_ptr of a gathered full -> unit
        self._unit_of_param = {id(p): u for u, gs in enumerate(self.units)
                               for g in gs for p in g.params}
        self._mark_params()
        self._handles = []
        for u, module in enumerate(modules):
            if self.numel[u] == 0:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(u)))

    def _mark_params(self) -> None:
        """Every sharded parameter becomes a ShardedParameter (zero/param_access.py) whose
        uses gather its unit and whose ds_* attributes read :meth:`describe`."""
        # id(param) -> (its position, its group, its slot)
        self._place = {id(p): (i, g, s) for i, (g, s, p) in enumerate(
            (g, s, p) for gs in self.units for g in gs
            for s, p in zip(g.layout.slots, g.params, strict=True))}
        forget_dead()
        for gs in self.units:
            for g in gs:
                for p in g.params:
                    mark_sharded(p, self._use_parameter, self.describe)

    # -- gather / release -------------------------------------------------------------------
    def gather_parameters(self, unit: int) -> None:
        """Issue the all-gathers of ``unit`` (no wait). A no-op if gathered or in flight."""
        self._gather_units([unit])

    def _gather_units(self, units: list[int], quantized: bool = False) -> None:
        """Issue the all-gathers of ``units`` in this order, after one order check for all
        (``quantized``: a hook's gather, quantized as ``self.quantize`` says)."""
        fresh = [u for u in dict.fromkeys(units) if not self.gathered[u] and u not in self.pending]
        if not fresh:
            return
        self._check_order(fresh)
        for u in fresh:
            self._issue_gather(u, quantized)

    def _quantized(self, g: FlatGroup) -> bool:
        return self.quantize == "all" or (self.quantize == "frozen" and not g.trainable)

    def _issue_gather(self, unit: int, quantized: bool = False) -> None:
        handles = []
        secondary = self.secondary.pop(unit, None)
        comm = self.comm if secondary is None else self.secondary_comm
        assert comm is not None  # secondary shards are kept only with a secondary communicator
        for i, g in enumerate(self.units[unit]):
            alloc_storage(g.full)
            self._unit_of_storage[g.full.untyped_storage().data_ptr()] = unit
            self.memory.add(g.full_nbytes)
            if secondary is not None:  # hpZ: from the secondary shards, inside the node
                self.memory.add(-secondary[i].numel() * secondary[i].element_size())
                handles.append(comm.all_gather(g.full, secondary[i]))
            elif quantized and self._quantized(g):  # qwZ: int8 blocks on the wire
                handles.append(self.comm.all_gather_quantized(
                    g.full, self._shard_on_device(g), block=QWZ_BLOCK))
            else:
                handles.append(self.comm.all_gather(g.full, self._shard_on_device(g)))
        self.pending[unit] = handles

    def _check_order(self, units: list[int]) -> None:
        """Every rank must be gathering the same units now, in the same order. Checked before
        the data moves: gloo aborts the process on an all-gather whose sizes differ between
        ranks, and equal sizes would silently mix two units' weights. One exchange per call
        (a hook's gather and its prefetches together), the payload of the phase check
        (faults/phase.py: a rank in another engine call fails there): [count, units...,
        -1 padding], the same size on every rank. (hpZ's secondary gathers are checked over
        every data-parallel rank too: all of them gather the same units at once.)"""
        rows = self.phases.post([len(units), *units], op="order_check")
        if rows is None:
            return
        comm = self.phases.comm
        assert comm is not None  # rows come back only from a group
        other = next((r for r, row in enumerate(rows) if row != rows[comm.rank]), None)
        if other is None:
            return
        theirs = rows[other][1:1 + rows[other][0]]
        i = next(i for i in range(len(units) + 1)
                 if i == len(units) or i == len(theirs) or units[i] != theirs[i])
        raise GatherOrderError(
            f"stage 3: rank {comm.rank} is gathering {self._describe(units, i)} while rank "
            f"{other} is gathering {self._describe(theirs, i)}; every rank must run the "
            "same units in the same order (rank-dependent control flow, e.g. skipping an "
            "expert that got no tokens, or a parameter used on one rank only). Run every "
            "module on every rank (an expert on an empty batch is fine), or use stage 0-2")

    def _describe(self, units: list[int], i: int) -> str:
        if i >= len(units):
            return "no further unit"
        return f"unit {units[i]} ({self.unit_names[units[i]]!r})"

    def _keep_secondary(self, unit: int) -> None:
        """hpZ, after forward: keep this rank's 1/k of the gathered unit for backward."""
        comm = self.secondary_comm
        assert comm is not None  # called only with hpZ (a secondary communicator)
        if unit in self.secondary:  # a unit run twice in one forward: kept already
            return
        kept = []
        for g in self.units[unit]:
            n = g.layout.padded_numel // comm.size
            kept.append(g.full[comm.rank * n:(comm.rank + 1) * n].clone())
            self.memory.add(n * g.full.element_size())
        self.secondary[unit] = kept

    def _shard_on_device(self, g: FlatGroup) -> torch.Tensor:
        """This rank's shard of ``g`` on the device (moved from host memory or a file)."""
        shard = g.shard if self.shard_source is None else self.shard_source.read_shard(g)
        if shard.device == self.device:
            return shard
        return shard.to(self.device, non_blocking=shard.is_pinned())

    def _read_ahead(self, order: list[int], pos: int) -> None:
        """NVMe parameters: start reading the shards of the next units of ``order``."""
        if self.shard_source is None or self.recording:
            return
        for u in order[pos + 1:]:
            if self.gathered[u] or u in self.pending:  # kept or prefetched: no read
                continue
            for g in self.units[u]:
                if not self.shard_source.prefetch_shard(g):
                    return

    def wait_parameters(self, unit: int, quantized: bool = False) -> None:
        self._gather_units([unit], quantized)
        for h in self.pending.pop(unit, []):
            h.wait()
        self.gathered[unit] = True

    def release_parameters(self, unit: int, force: bool = False) -> None:
        """Free ``unit``'s full buffers, unless it is still in use (running, or sticky)."""
        if not force and (unit in self.sticky or self.depth[unit] > 0):
            return
        if unit in self.pending:
            self.wait_parameters(unit)
        if not self.gathered[unit]:
            return
        for g in self.units[unit]:
            self._unit_of_storage.pop(g.full.untyped_storage().data_ptr(), None)
            free_storage(g.full)
            self.memory.add(-g.full_nbytes)
        self.gathered[unit] = False

    def release_all(self) -> None:
        """Free every unit (end of backward, after the step: shards may have changed)."""
        self.sticky.clear()
        for u in range(len(self.units)):
            self.release_parameters(u, force=True)

    def ensure_gathered(self, unit: int) -> None:
        """A use outside the unit's own hooks: gather it now and keep it until the end of
        backward or the next step (autograd may hold views of it until then)."""
        if not self.gathered[unit] or unit in self.pending:
            self.wait_parameters(unit)
        self.sticky.add(unit)

    def _regather(self, unit: int) -> None:
        """Backward unpacks a saved view of ``unit``: gather it if it was released (then it
        stays until the end of backward, its gradients being in already)."""
        if not self.gathered[unit] or unit in self.pending:
            self.wait_parameters(unit, quantized=True)

    def _use_parameter(self, param) -> None:
        unit = self._unit_of_param[id(param)]
        if not self.gathered[unit] or unit in self.pending:
            self.ensure_gathered(unit)

    def describe(self, param) -> ParamInfo:
        """DeepSpeed's stage-3 attributes of ``param`` (zero/param_access.py): its
        position, whether its unit is gathered, its full size and its part of the shard."""
        index, group, slot = self._place[id(param)]
        unit = self._unit_of_param[id(param)]
        status = (ZeroParamStatus.INFLIGHT if unit in self.pending
                  else ZeroParamStatus.AVAILABLE if self.gathered[unit]
                  else ZeroParamStatus.NOT_AVAILABLE)
        lo, hi = group.owned
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        local = group.shard[a - lo:b - lo] if a < b else group.shard[:0]
        return ParamInfo(index, status, slot.numel, torch.Size(slot.shape), local)

    def gather_for(self, params) -> list[int]:
        """``engine.gathered(params)``: gather the units of ``params``; returns the units
        that were not gathered before (to release on exit)."""
        units = sorted({self._unit_of_param[id(p)] for p in params
                        if id(p) in self._unit_of_param})
        fresh = [u for u in units if not self.gathered[u] and u not in self.sticky]
        for u in units:
            self.ensure_gathered(u)
        return fresh

    def saved_tensor_hooks(self) -> SavedParameterHooks:
        """Around forward: saved views of a gathered unit regather it when backward needs it."""
        return SavedParameterHooks(self._unit_of_storage.get, self._regather)

    def _live_numel(self) -> int:
        return sum(self.numel[u] for u in range(len(self.units))
                   if self.gathered[u] or u in self.pending)

    def _prefetch_list(self, order: list[int], pos: int, current: int) -> list[int]:
        """The units after ``pos`` in ``order`` to gather ahead, within the prefetch and live
        budgets (``current``, about to be gathered, counts as live). Units already gathered
        or in flight ahead count against the prefetch budget too, so at most
        ``prefetch_numel`` elements are ever fetched ahead of use."""
        budget = self.prefetch_numel
        fresh = not self.gathered[current] and current not in self.pending
        live = self._live_numel() + (self.numel[current] if fresh else 0)
        out: list[int] = []
        for u in order[pos + 1:]:
            if u == order[pos]:
                continue
            if self.numel[u] > budget:
                break
            budget -= self.numel[u]
            if self.gathered[u] or u in self.pending or u in out or u == current:
                continue
            if live + self.numel[u] > self.max_live_numel:
                break
            live += self.numel[u]
            out.append(u)
        return out

    def _gather_with_prefetch(self, unit: int, order: list[int], pos: int) -> None:
        """A hook's gathers: ``unit`` (if not gathered) and, after the first step, the units
        ahead in ``order``, issued after one order check, then wait for ``unit``."""
        ahead = [] if self.recording else self._prefetch_list(order, pos, unit)
        self._gather_units([unit, *ahead], quantized=True)
        self.wait_parameters(unit)

    # -- hooks ------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: int):
        def pre_forward(module, args):
            if self.in_backward:  # activation-checkpoint recompute: already gathered
                self.wait_parameters(unit)
                return
            if self.recording:
                self.fwd_order.append(unit)
            self._read_ahead(self.fwd_order, self.fwd_pos)
            self._gather_with_prefetch(unit, self.fwd_order, self.fwd_pos)
            self.depth[unit] += 1
            self.fwd_pos += 1

        return pre_forward

    def _keep_gathered(self, unit: int) -> bool:
        """Whether ``unit`` stays gathered after this forward use: it runs again in this
        forward within max_reuse_distance elements, or this is its last forward use and the
        reuse plan keeps it for backward (zero/gather_plan.py)."""
        if self.recording:
            return False
        distance = 0
        for u in self.fwd_order[self.fwd_pos:]:
            if u == unit:
                return distance <= self.max_reuse_distance
            distance += self.numel[u]
        return unit in self.kept and torch.is_grad_enabled()

    def _make_post_forward(self, unit: int):
        def post_forward(module, args, output):
            if self.in_backward:  # recompute inside this unit's backward: keep it gathered
                return None
            self.depth[unit] -= 1
            tensors = output_tensors(output)
            if self._views_unit(unit, tensors):
                self.sticky.add(unit)  # the caller computes with this unit's own storage
            if self.recording and self.depth[unit] == 0:
                self.release_pos[unit] = self.fwd_pos
            if not self._keep_gathered(unit) and self.depth[unit] == 0 \
                    and unit not in self.sticky:
                if self.secondary_comm is not None and torch.is_grad_enabled():
                    self.wait_parameters(unit)
                    self._keep_secondary(unit)
                self.release_parameters(unit)
            if torch.is_grad_enabled():
                needs_grad = [t for t in tensors if t.requires_grad]
                if needs_grad:
                    register_multi_grad_hook(needs_grad, self._make_pre_backward(unit),
                                             mode="any")
            return None

        return post_forward

    def _views_unit(self, unit: int, tensors: list[torch.Tensor]) -> bool:
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        return any(self._unit_of_storage.get(p) == unit for p in ptrs)

    def _make_pre_backward(self, unit: int):
        def pre_backward(_grad) -> None:
            if self.recording:
                self.bwd_order.append(unit)
            self._read_ahead(self.bwd_order, self.bwd_pos)
            self._gather_with_prefetch(unit, self.bwd_order, self.bwd_pos)
            self.bwd_pos += 1

        return pre_backward

    def start_forward(self) -> None:
        """Called by the engine before every forward pass."""
        self.fwd_pos = 0
        self.depth = [0] * len(self.units)  # a forward that raised leaves no unit running
        if self.recording:  # keep only the forward that precedes the first backward
            self.fwd_order.clear()

    def start_backward(self) -> None:
        self.bwd_pos = 0
        self.in_backward = True

    def end_backward(self) -> None:
        """After a backward: release everything; the first step's orders are now recorded."""
        self.release_all()
        for kept in self.secondary.values():  # units that had no backward
            self.memory.add(-sum(t.numel() * t.element_size() for t in kept))
        self.secondary.clear()
        if self.recording:
            self.kept = plan_reuse(self.fwd_order, self.bwd_order, self.numel, self.release_pos,
                                   max_reuse_distance=self.max_reuse_distance,
                                   max_live_parameters=self.max_live_numel)
        self.recording = False
        self.in_backward = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for gs in self.units:
            for g in gs:
                for p in g.params:
                    unmark_sharded(p)

"""The ZeRO model state of one rank: units, flat groups, hooks, and what they hold.

Stages compose rather than copy each other (DESIGN.md section 3):

    stage 0  full params, full grads (all-reduced), full optimizer state
    stage 1  + master and optimizer state only for this rank's shard
    stage 2  + gradients reduce-scattered during backward into the shard
    stage 3  + parameters at rest are only the shard (ParameterSharder)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.faults.phase import PhaseCheck
from meshzero.zero.flat_buffer import FlatGroup
from meshzero.zero.offload import (  # noqa: F401  (CATEGORIES, TIERS: re-exported)
    CATEGORIES,
    TIERS,
    OffloadOptions,
    make_tier,
)
from meshzero.zero.offload.states import StateOffload, state_names
from meshzero.zero.offload.transfer import StepTransfers
from meshzero.zero.owners import register_owner
from meshzero.zero.quantized_grads import HierarchicalReduceScatter
from meshzero.zero.reducer import GradientReducer
from meshzero.zero.sharded_optimizer import ShardedOptimizerState
from meshzero.zero.sharded_params import (
    GatheredMemory,
    ParameterSharder,
    order_check_communicator,
)
from meshzero.zero.state_reads import StateReads
from meshzero.zero.trainability import Trainability
from meshzero.zero.units import Layout, ParamSlot, build_layout
from meshzero.zero.write_back import Target, broadcast_values, check_modifier_rank, write_values

NO_OPTIMIZER = ("this engine has no optimizer (forward only): pass optimizer= or a config "
                "'optimizer' block to train")


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
    # gradients are divided by this before the reduction (DeepSpeed's prescale_gradients /
    # gradient_predivide_factor); the step divides by dp_size / grad_predivide after it
    grad_predivide: float = 1.0
    # gradients are held, accumulated and reduced in this dtype (data_types.grad_accum_dtype);
    # the fp32 master is stepped on them converted a chunk at a time (zero/offload/stepping.py)
    grad_dtype: torch.dtype = torch.float32
    # the master's dtype: fp32, or bf16 with bf16.bf16_master_weights_and_grads (then in bf16
    # training the compute parameters are the master, as in fp32 training)
    master_dtype: torch.dtype = torch.float32
    # of the process groups ZeRO makes itself (the unit-order check's): faults.comm_timeout
    group_timeout: timedelta | None = None
    # no optimizer (a frozen reference / reward / EMA model): parameters only, no master,
    # gradients or optimizer states; forward runs without autograd, backward is refused
    forward_only: bool = False
    # ZeRO++ qwZ: which groups stage 3's hook gathers move as int8 ("all", "frozen", "none")
    quantize_weights: str = "none"


class ZeroModelState(StateReads):
    def __init__(self, model: nn.Module, comm: Communicator, device: torch.device,
                 options: ZeroOptions,
                 materialize: Callable[[Layout], Iterable[tuple[int, dict[int, torch.Tensor]]]]
                 | None = None,
                 secondary_comm: Communicator | None = None,
                 replica_comm: Communicator | None = None,
                 grad_reduce: HierarchicalReduceScatter | None = None):
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
        # where master, gradient shard and optimizer states live, and how they step: decided
        # here once, from the config (zero/offload/)
        self.tier = make_tier(options.offload, comm=comm, device=device, layout=self.layout,
                              stage=stage, compute_dtype=options.compute_dtype,
                              grad_dtype=options.grad_dtype, master_dtype=options.master_dtype)
        self.units: list[list[FlatGroup]] = self._build_units(materialize)
        self.groups = [g for gs in self.units for g in gs]
        self.replica_comm = replica_comm  # MiCS: gathered writes cross the replicas too
        # id(parameter) -> its flat group and slot (the lookup of gathered writes)
        self._slots = {id(p): (g, s) for g in self.groups
                       for s, p in zip(g.layout.slots, g.params, strict=True)}
        register_owner(self, (p for g in self.groups for p in g.params))
        resident = sum(g.full_nbytes for g in self.groups if not g.sharded)
        self.memory = GatheredMemory(resident)
        self.optim_state = ShardedOptimizerState(
            self.groups, comm, stage=stage, allgather_bucket_numel=options.allgather_bucket_numel,
            tier=self.tier)
        self.tier.attach(self.units, self.optim_state)
        self.phases, self.sharder = self._build_sharder(secondary_comm)
        self.reducer = GradientReducer(
            self.units, comm, stage=stage, comm_dtype=options.comm_dtype,
            bucket_numel=options.reduce_bucket_numel, on_unit_ready=self._on_unit_ready,
            on_unit_reduced=self.tier.on_unit_reduced, replica_comm=replica_comm,
            predivide=options.grad_predivide, grad_reduce=grad_reduce,
        )
        self.optimizer: torch.optim.Optimizer | None = None
        # id(parameter) -> the optimizer param group it was given in (frozen ones included)
        self.param_group_of: dict[int, int] = {}
        self.trainability = Trainability(self.groups, make_trainable=self._make_trainable)
        self._kept_units: set[int] = set()  # stage 3: units holding a frozen parameter now
        self.closed = False
        self._transfers: StepTransfers = StepTransfers()  # of the last optimizer step
        # states moved to host memory by offload_states (zero/offload/states.py)
        self.offloaded = StateOffload(device, self.tier.name, options.offload.param)

    def _build_sharder(self, secondary_comm: Communicator | None,
                       ) -> tuple[PhaseCheck, ParameterSharder | None]:
        """The phase check every collective entry point posts to first (faults/phase.py; at
        stage 3 the unit-order check rides on it: [count, units..., -1 padding]) and, at
        stage 3, the sharder that gathers and releases units."""
        options, comm, stage = self.options, self.comm, self.options.stage
        names = [u.path or "<root>" for u in self.layout.units]
        phases = PhaseCheck(
            order_check_communicator(comm, options.group_timeout), comm.stats,
            torch.device("cpu"),  # a gloo group: the check never waits on the device
            payload=len(self.layout.units) + 1 if stage == 3 else 0, unit_names=names,
            watch=comm.gloo)  # gloo's waits can be watched: no posts ahead (faults/stall.py)
        if stage != 3:
            return phases, None
        return phases, ParameterSharder(
            [self.model.get_submodule(u.path) for u in self.layout.units], self.units, comm,
            self.memory, prefetch_numel=options.prefetch_numel,
            max_live_numel=options.max_live_numel,
            max_reuse_distance=options.max_reuse_distance, phases=phases,
            shard_source=self.tier.shard_source(), secondary_comm=secondary_comm,
            unit_names=names, quantize=options.quantize_weights)

    def _build_units(
        self, materialize: Callable[[Layout], Iterable[tuple[int, dict[int, torch.Tensor]]]]
        | None,
    ) -> list[list[FlatGroup]]:
        """Each unit's flat groups. A meta-device model is made real unit by unit, each unit's
        groups built as soon as it is complete, its fp32 values in flat buffers the groups take
        over (popped: at stage 3 they are freed with the full buffer; zero/materialize.py);
        else in order."""
        n_units, opts = len(self.layout.units), self.options
        ready = ((u, {}) for u in range(n_units)) if materialize is None \
            else materialize(self.layout)
        built: dict[int, list[FlatGroup]] = {}
        for u, flats in ready:
            built[u] = [
                FlatGroup(g, [self.model.get_parameter(s.name) for s in g.slots],
                          stage=opts.stage, rank=self.comm.rank,
                          compute_dtype=opts.compute_dtype, device=self.device,
                          tier=self.tier, init=flats.pop(g.index, None),
                          trains=not opts.forward_only)
                for g in self.layout.units[u].groups
            ]
        return [built[u] for u in range(n_units)]

    # -- the optimizer step (the tier runs it) -----------------------------------------------
    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer over the fragments must live."""
        return self.tier.optimizer_device

    def attach_optimizer(self, optimizer: torch.optim.Optimizer,
                         param_group_of: dict[int, int] | None = None) -> None:
        """``param_group_of``: id(parameter) -> the param group it was passed in, frozen
        ones included (where a frozen group's fragments go if it is unfrozen later)."""
        self.optimizer = optimizer
        self.param_group_of = param_group_of or {}
        self.tier.attach_optimizer(optimizer)

    def _make_trainable(self, group: FlatGroup) -> None:
        """A group frozen at initialize gets a master, gradients and optimizer leaves
        (zero/trainability.py); a parameter passed in no param group is never stepped, as
        in plain torch."""
        assert self.optimizer is not None, "the optimizer is attached before any backward"
        group.make_trainable()
        added = self.optim_state.add_group(group)
        for p, leaves in added.items():
            index = self.param_group_of.get(id(p))
            if index is None:
                self.trainability.outside.add(id(p))
                index = 0  # in a group for the checkpoint's sake, but always skipped
            self.optimizer.param_groups[index]["params"].extend(leaves)
        self.reducer.add_group(group.layout.unit, group)
        self.tier.group_added(group)
        self.tier.attach_optimizer(self.optimizer)

    def make_trainable(self, names: Iterable[str]) -> None:
        """Make the frozen groups holding the parameters ``names`` trainable (a checkpoint
        that saved optimizer state for them is being loaded)."""
        wanted = set(names)
        for g in self.groups:
            if not g.trainable and any(s.name in wanted for s in g.layout.slots):
                self._make_trainable(g)

    def keep_gradients_local(self, on: bool) -> None:
        """Stage 0: each rank keeps its own gradient instead of the all-reduced mean (an
        optimizer that communicates its momentum instead: optimizers/onebit.py)."""
        assert not on or self.options.stage == 0, "local gradients need stage 0"
        self.reducer.local_gradients = on

    def finish_unit_steps(self) -> bool:
        """Wait for the unit steps of the last backward; True if it stepped everything."""
        return self.tier.finish_unit_steps()

    def unit_steps_sq_norm(self) -> float | None:
        """This rank's squared gradient norm after the tier stepped units in backward."""
        return self.tier.unit_steps_sq_norm()

    def unit_step_outcome(self) -> tuple[int, int]:
        """(units stepped, units refused for inf/nan gradients) during the last backward."""
        return self.tier.unit_step_outcome()

    def start_step(self) -> bool:
        """The step at the accumulation boundary: the phase check, then
        :meth:`agree_io_failures`, before any other collective of the step. The step's
        first collective is its non-finite check, whose sum is a phase exchange (StepGuard):
        only an NVMe tier's I/O agreement comes before it and needs a post of its own."""
        self.phases.enter("step", post=self.has_reduced_gradients() and self.tier.name == "nvme")
        return self.agree_io_failures()

    def agree_io_failures(self) -> bool:
        """Collective, before any other of the step: whether a rank's offload I/O lost
        gradient data (NVMe); then the gradients and units still gathered (they may hold
        what a failed read gave) are dropped, and :meth:`refuse_lost_step` raises on every
        rank until a new backward."""
        if not self.tier.agree_io_failures():
            return False
        self.zero_grads()
        self.after_step()
        return True

    def refuse_lost_step(self) -> None:
        self.tier.refuse_lost_step()

    def optimizer_step(self, scale: float) -> None:
        """Scale the gradients by ``scale`` and step every fragment (not yet in params)."""
        self.tier.step(scale)

    def materialized(self, write_back: bool = False) -> AbstractContextManager[None]:
        """A context in which every master, optimizer state and shard is in memory (a tier
        that keeps them in files reads them in; ``write_back`` writes changes back)."""
        self.offloaded.check("checkpoint")
        return self.tier.materialized(write_back)

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
        if self.phases.posts_ahead:  # every rank reduces now (faults/phase.py)
            self.phases.post()
        self._track_requires_grad()
        self.reducer.reduce_param_grads()

    def close(self) -> None:
        """Join the tier's worker threads (unit stepper, NVMe I/O) and remove its files;
        no training afterwards."""
        self.closed = True
        self.tier.close()
        self.phases.close()
        # the parameters' hooks hold the reducer and sharder (and through them the process
        # groups) in a cycle the garbage collector cannot see through; removed, the state is
        # freed with the engine
        self.reducer.remove_hooks()
        if self.sharder is not None:
            self.sharder.remove_hooks()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine was closed (engine.close() or the end of "
                               "`with engine:`); build a new one with meshzero.initialize "
                               "to train again")

    def _on_unit_ready(self, unit: int) -> None:
        """All grads of ``unit`` are in: at stage 3 its full params can go (unless frozen
        sharded params may still be needed by backward; those go at the end of backward)."""
        if self.sharder is not None and unit not in self._kept_units \
                and all(g.trainable for g in self.units[unit] if g.sharded):
            self.sharder.release_parameters(unit)

    # -- step hooks used by the engine -----------------------------------------------------------
    def require_states(self, call: str = "step") -> None:
        """Before a backward or a step (``call``): the states it needs are here. An engine
        built without an optimizer refuses both, as one whose states ``call`` reads are
        offloaded (offload_states) does."""
        if self.options.forward_only:
            raise ValueError(NO_OPTIMIZER)
        self.offloaded.check(call)

    def offload_states(self, include: Iterable[object] | None = None, *,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move the states named in ``include`` (DeepSpeed's names; None: all) to host
        memory until :meth:`reload_states` (zero/offload/states.py). Local: no collective."""
        names = state_names(include)  # checked before anything moves
        if self.sharder is not None and "lp_params" in names:
            self.sharder.release_all()  # gathered units go: only the shards remain
        self.offloaded.offload(names, self.groups, self.optimizer, pin_memory=pin_memory,
                               non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved (a no-op if nothing is away)."""
        self.offloaded.reload(non_blocking)

    def start_forward(self) -> AbstractContextManager[object]:
        """Before a forward; returns the context to run it in (stage 3: tensors autograd
        saves that view a unit's parameters gather it again if backward finds it released).
        Without an optimizer: under ``torch.no_grad()`` (no backward can follow, so no
        graph, no activations kept and no unit held gathered for one)."""
        self._check_open()
        self.offloaded.check("forward")
        if self.options.forward_only:
            if self.sharder is not None:
                self.sharder.start_forward()
            return torch.no_grad()
        if self.sharder is None:
            return nullcontext()
        self.sharder.start_forward()
        return self.sharder.saved_tensor_hooks()

    @contextmanager
    def gathered(self, params: Iterable[torch.Tensor], modifier_rank: int | None = None):
        """The full values of ``params`` inside the block (a collective: enter it on every
        rank). Stage 3 gathers their units; at stages 0-2 they are full already. Units
        gathered for it are released on exit, unless autograd may still read them (grad
        mode on): then at the end of the next backward or step.

        ``modifier_rank``: the data-parallel rank whose writes into these parameters are
        kept: on a clean exit its values (same shapes) reach every rank's master, shard and
        compute parameters (zero/write_back.py). None: read-only, a write is lost."""
        params = list(dict.fromkeys(params))  # tensors hash by identity
        targets = None if modifier_rank is None else self._write_targets(params, modifier_rank)
        fresh = [] if self.sharder is None else self.sharder.gather_for(params)
        try:
            yield
            if targets is not None and modifier_rank is not None:
                with self.materialized(write_back=True):
                    values = broadcast_values(
                        targets, comm=self.comm, replica_comm=self.replica_comm,
                        modifier_rank=modifier_rank, device=self.device)
                    write_values(targets, values)
        finally:
            if self.sharder is not None and not torch.is_grad_enabled():
                for u in fresh:
                    self.sharder.sticky.discard(u)
                    self.sharder.release_parameters(u)

    def slot_of(self, param: torch.Tensor) -> tuple[FlatGroup, ParamSlot] | None:
        """The flat group and slot of ``param``, or None if this state does not hold it."""
        return self._slots.get(id(param))

    def _write_targets(self, params: list[torch.Tensor], modifier_rank: int) -> list[Target]:
        """What a gathered block with ``modifier_rank`` writes back, in slot order (the same
        on every rank); checked before the block runs."""
        self._check_open()
        check_modifier_rank(modifier_rank, self.comm.size * (
            self.replica_comm.size if self.replica_comm is not None else 1))
        targets = []
        for p in params:
            found = self.slot_of(p)
            if found is None:
                raise ValueError(f"gathered(modifier_rank={modifier_rank}): a parameter of "
                                 f"shape {tuple(p.shape)} is not held by this engine")
            targets.append(Target(p, found[1], found[0]))
        return sorted(targets, key=lambda t: (t.slot.unit, t.slot.group, t.slot.offset))

    def after_step(self) -> None:
        """Stage 3: units still gathered (used after backward) hold the old values: free them."""
        if self.sharder is not None:
            self.sharder.release_all()

    def start_backward(self, boundary: bool, step_scale: float | None = None) -> None:
        """``step_scale``: nothing global is needed before the step, so on the boundary the
        tier may step each unit as soon as its gradient is reduced, times ``step_scale``."""
        self._check_open()
        self._track_requires_grad()
        # a backward that reduces gradients is a collective: every rank must be in one
        self.phases.enter("backward", post=boundary or self.options.stage >= 2)
        self.tier.start_backward(boundary, step_scale)
        self.reducer.spread_nonfinite = (step_scale is not None
                                         and self.tier.steps_units_in_backward)
        self.reducer.begin_backward(boundary)
        if self.sharder is not None:
            self.sharder.start_backward()

    def _track_requires_grad(self) -> None:
        """Before gradients are reduced: requires_grad as it is now decides what the step
        skips and which frozen groups become trainable (zero/trainability.py)."""
        opened = self.trainability.before_backward()
        frozen = self.trainability.frozen_now
        self.optim_state.skip(self.trainability.skipped)
        self.reducer.set_frozen(frozen, opened)
        self._kept_units = {u for u, gs in enumerate(self.units) for g in gs if g.sharded
                            for p in g.params if id(p) in frozen} if frozen else set()

    def finish_backward(self) -> None:
        self.reducer.finish_backward()
        if self.sharder is not None:
            self.sharder.end_backward()

    def has_reduced_gradients(self) -> bool:
        """Whether a gradient reduction ran since the last ``zero_grads`` (a backward on the
        accumulation boundary, or at stages 2-3 any backward)."""
        return not self.reducer.grads_are_zero

    def zero_grads(self) -> None:
        self.optim_state.zero_grads()
        self.reducer.grads_are_zero = True
        self.trainability.close_window()

    # -- reports ------------------------------------------------------------------------------
    def close_transfer_window(self) -> None:
        """The end of an optimizer step: its offload copies become :meth:`transfer_report`'s."""
        self._transfers = self.tier.transfer_step()

    def transfer_report(self) -> dict[str, dict]:
        """Per direction (d2h, h2d, nvme_read, nvme_write) the bytes, seconds, exposed
        seconds, count and pinned count of the last optimizer step's offload copies (on CUDA
        the copy times are read from their events here, waiting for any still running)."""
        return self._transfers.report()

    def memory_report(self, optimizer: torch.optim.Optimizer | None) -> dict:
        """Bytes this rank holds at rest, by category and the tier each buffer lives in, plus
        the tier's staging buffers under ``offload_buffers``."""
        report = self.tier.memory_report(self.groups, optimizer)
        self.offloaded.adjust(report)  # what offload_states moved is in host memory now
        report["gathered_params_peak"] = self.memory.peak
        return report

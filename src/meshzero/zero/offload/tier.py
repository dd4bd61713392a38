"""The :class:`Tier` protocol, the offload options it is chosen from, and host buffers.

A tier owns where this rank's fp32 master shard, gradient shard and optimizer states live,
how an optimizer step runs on them and how many bytes each memory tier holds. ZeRO builds
one from the config (:func:`meshzero.zero.offload.make_tier`) and asks it, never the config:

    DeviceTier  (offload_optimizer none)  on the device; the plain ``optimizer.step()``
    HostTier    (cpu)                     in host memory; units stepped during backward
    NvmeTier    (nvme)                    in files; stepped tile by tile

Where stage-3 parameter shards live (``offload_param``) is the second axis of the same
options: every tier places them (:meth:`Tier.param_shard`); only the NVMe tier can keep
them in files.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from meshzero.log import warn_once
from meshzero.zero.offload.stepping import Chunk, chunk_numel, plan_chunks, step_chunks
from meshzero.zero.offload.transfer import StepTransfers, Transfers

if TYPE_CHECKING:
    from meshzero.comm import Communicator
    from meshzero.zero.flat_buffer import FlatGroup
    from meshzero.zero.sharded_optimizer import ShardedOptimizerState
    from meshzero.zero.units import Layout

    from .nvme_io import TilePlanner

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
TIERS = ("device", "host", "nvme")
CATEGORIES = ("params", "master_params", "grads", "optimizer_states")


@dataclass(frozen=True)
class OffloadOptions:
    optimizer: str = "none"  # none | cpu | nvme
    param: str = "none"
    optimizer_nvme_path: str | None = None
    param_nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4  # optimizer tiles in host memory at once (nvme)
    param_buffer_count: int = 5  # unit shards read ahead (param nvme)
    sub_group_size: int = 1_000_000_000

    @classmethod
    def from_config(cls, zc) -> OffloadOptions:
        """``pin_memory``: true if either section says true; unset in both, true when CUDA
        is present (DeepSpeed's habit); an explicit false is honoured."""
        opt, par = zc.offload_optimizer, zc.offload_param
        given = [s.pin_memory for s in (opt, par) if "pin_memory" in s.model_fields_set]
        pin = (any(given) and _can_pin()) if given else torch.cuda.is_available()
        return cls(optimizer=opt.device, param=par.device, optimizer_nvme_path=opt.nvme_path,
                   param_nvme_path=par.nvme_path, pin_memory=pin,
                   buffer_count=opt.buffer_count, param_buffer_count=par.buffer_count,
                   sub_group_size=zc.sub_group_size)

    @property
    def optimizer_tier(self) -> str:
        return {"none": "device", "cpu": "host", "nvme": "nvme"}[self.optimizer]

    @property
    def param_tier(self) -> str:
        return {"none": "device", "cpu": "host", "nvme": "nvme"}[self.param]


def _can_pin() -> bool:
    if torch.cuda.is_available():
        return True
    warn_once(logger, "offload pin_memory is ignored: there is no CUDA device to pin for")
    return False


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


def host_copy(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.empty(t.numel(), dtype=dtype or t.dtype, pin_memory=pin)
    out.copy_(t.detach().reshape(-1))
    return out


def placeholder(numel: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """A tensor of ``numel`` elements whose storage is empty: its values live elsewhere (an
    NVMe file) and are swapped in by pointing ``.data`` at a buffer."""
    t = torch.empty(max(numel, 1) if shape == () else numel, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t.view(shape) if shape is not None else t


class ShardsToDevice:
    """The sharder's ``shard_source`` with parameter offload: a group's shard read from
    ``source`` (an NVMe store; None: the group's host shard) and copied to a fresh device
    tensor through ``transfers`` (counted as h2d), at the all-gather or its prefetch."""

    def __init__(self, transfers: Transfers, device: torch.device, source=None) -> None:
        self.transfers, self.device, self.source = transfers, device, source

    def read_shard(self, g: FlatGroup) -> torch.Tensor:
        source = self.source
        host = g.shard if source is None else source.read_shard(g)
        out = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        self.transfers.to_device(out, host, None if source is None
                                 else lambda: source.release_shard(host))
        return out

    def prefetch_shard(self, g: FlatGroup) -> bool:
        """Start reading ahead (files); a host shard needs none."""
        return True if self.source is None else self.source.prefetch_shard(g)


def elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping a subset of the leaves gives each the update a step over all of them
    would (torch's optimizers; not LAMB, whose trust ratio needs whole-parameter norms), so a
    tier may step units, chunks or tiles apart."""
    return getattr(optimizer, "elementwise", True)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Tier(ABC):
    """Where the optimizer side of one rank lives and how it steps (module docstring).

    Each tier makes the master and the gradient shard of a group. The defaults are what
    tiers share: the optimizer runs on the host over a master of its own, gradient shards
    and states are tensors stepped in place, nothing is stepped during backward; a tier
    overrides what it does differently.
    """

    name: ClassVar[str]  # the memory_report tier of master, gradient shard and states
    # whether an exact gradient norm costs a read of every gradient back from storage (NVMe):
    # then the step takes it only when clipping needs it
    norm_reads_storage: ClassVar[bool] = False
    # set by attach / attach_optimizer, once the groups and the optimizer exist
    optim_state: ShardedOptimizerState
    optimizer: torch.optim.Optimizer

    def __init__(self, options: OffloadOptions, *, comm: Communicator, device: torch.device,
                 layout: Layout, stage: int, compute_dtype: torch.dtype,
                 grad_dtype: torch.dtype = torch.float32,
                 master_dtype: torch.dtype = torch.float32):
        """``grad_dtype``: the dtype of the gradient shard the tier keeps; ``master_dtype``:
        the master's (fp32, or bf16 with bf16.bf16_master_weights_and_grads)."""
        self.options = options
        self.comm = comm
        self.device = device
        self.layout = layout
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        self.master_dtype = master_dtype
        self.units: list[list[FlatGroup]] = []
        self.chunks: list[Chunk] | None = None  # 16-bit gradients: stepped chunk by chunk
        # every copy between the device and this tier's host buffers, counted (transfer.py)
        self.transfers = Transfers(device, options.pin_memory)
        # id(group) -> norm of its reduced gradient, taken on the device before it crossed,
        # in a boundary backward whose step reads them (None: not wanted, or accumulated)
        self._norms: dict[int, torch.Tensor] | None = None
        self._norm_dtype = torch.float64

    # -- where things live (each tier says) ----------------------------------------------------
    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer (its leaves and states) runs: the host, for an offload tier."""
        return HOST

    def master_is_copy(self, compute_dtype: torch.dtype) -> bool:
        """Whether the fp32 master is its own buffer rather than the compute parameters
        (always, for an offload tier)."""
        return True

    def owned_values(self, group: FlatGroup) -> torch.Tensor:
        """The compute-dtype values of ``group``'s owned range, wherever they live now (a
        group frozen at initialize made trainable: its master starts from them)."""
        return group.owned_params()

    @abstractmethod
    def master(self, group: FlatGroup, init: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``group``'s owned range from ``init`` (its exact fp32 values)."""

    @abstractmethod
    def grad_shard(self, group: FlatGroup) -> torch.Tensor | None:
        """The gradient shard of ``group``'s owned range (None: it is kept elsewhere)."""

    @property
    def param_tier(self) -> str:
        """The memory_report tier of the stage-3 parameter shards."""
        return self.options.param_tier

    def param_shard(self, owned: torch.Tensor) -> torch.Tensor:
        """The stage-3 parameter shard with its own storage, made from ``owned`` (a view of
        the full buffer): a host buffer with parameter offload."""
        if self.options.param != "none":
            return host_copy(owned, self.options.pin_memory)
        return owned.clone()

    def tile_planner(self) -> TilePlanner | None:
        """A planner when the optimizer space is stepped in tiles out of memory (fragments
        are cut where tiles begin and their leaves hold no memory between steps)."""
        return None

    def split_numel(self) -> int | None:
        """With 16-bit gradient shards in memory: the most elements of one optimizer leaf
        (longer fragments are cut), so the step converts at most that much gradient to
        fp32 at once (stepping.py). None: fp32 gradients, leaves are whole fragments."""
        if self.grad_dtype == self.master_dtype:  # the gradient can be the leaves' .grad
            return None
        return chunk_numel(self.options.sub_group_size)

    def shard_source(self):
        """With parameter offload, what gives the sharder a stage-3 shard on the device
        (copied from its host buffer through :attr:`transfers`); None: on the device."""
        if self.options.param == "none":
            return None
        return ShardsToDevice(self.transfers, self.device)

    # -- wiring ------------------------------------------------------------------------------
    def attach(self, units: list[list[FlatGroup]], optim_state: ShardedOptimizerState) -> None:
        """The built groups (by unit) and the optimizer leaves over them."""
        self.units = units
        self.optim_state = optim_state

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.transfers.take()  # what construction moved is no step's
        numel = self.split_numel()
        if numel is not None:
            if not elementwise(optimizer):  # one step over every leaf: one chunk of all
                numel = max(self.optim_state.space_numel, 1)
            self.chunks = plan_chunks(optimizer, self.optim_state.grad_views, numel)

    # -- gradients and the step ----------------------------------------------------------------
    def store_grad(self, group: FlatGroup, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient ``out`` of ``group``'s owned range (on the device) into its
        gradient shard in host memory; ``accumulate`` adds to what earlier micro-steps
        left. It crosses in the gradient dtype straight into the shard (page-locked on
        CUDA, on the copy stream: backward does not wait), or, to be added, into a staging
        buffer that the worker adds once it has landed (``out``'s dtype: the same single
        rounding as an add on the device)."""
        grad = group.grad
        assert grad is not None, "an in-memory tier keeps every gradient shard"
        if group.grad_stale:  # it stands for zeros: the sum is this gradient
            group.grad_stale, accumulate = False, False
        if accumulate:
            self._norms = None  # the norm of a sum: read from the host after all
            self.transfers.to_host_staged(out, grad.add_)
            return
        src = out if out.dtype == grad.dtype else out.to(grad.dtype)
        self.note_norm(group, src)
        self.transfers.to_host(grad, src)

    # -- partial norms on the device ---------------------------------------------------------
    def want_norms(self, boundary: bool, dtype: torch.dtype) -> None:
        """A boundary backward whose step reads the gradient norm (fp64, exact as
        grad_scan.py's) or only their finiteness (fp32): each group's norm is taken on the
        device as its gradient is stored, before it crosses."""
        self._norms = {} if boundary else None
        self._norm_dtype = dtype

    def note_norm(self, group: FlatGroup, grad: torch.Tensor) -> None:
        """``grad`` (on the device) is ``group``'s whole gradient shard for this step."""
        if self._norms is not None:  # no sync: a 0-d tensor on the device
            self._norms[id(group)] = torch.linalg.vector_norm(grad, dtype=self._norm_dtype)

    def device_grad_stats(self, need_norm: bool) -> tuple[float, float] | None:
        """(squared norm, non-finite groups) from the norms taken on the device, summed as
        :func:`~meshzero.zero.grad_scan.scan_grads` sums them (bit-identical); None when
        they do not cover every gradient (accumulated, or a norm wanted in fp64 was taken
        in fp32, or an fp32 norm overflowed: an exact read decides)."""
        stacked = self._take_norms()
        if stacked is None or need_norm and self._norm_dtype != torch.float64:
            return None
        bad = float((~torch.isfinite(stacked)).sum())
        if bad and self._norm_dtype != torch.float64:
            return None
        sq = float((stacked.square() * 1.0).sum()) if need_norm else 0.0
        return sq, bad

    def unit_steps_sq_norm(self) -> float | None:
        """This rank's squared gradient norm after units were stepped during backward, from
        the fp32 norms their finiteness was checked with (summed in fp64); None when they
        do not cover every gradient or one is not finite."""
        stacked = self._take_norms()
        if stacked is None or not bool(torch.isfinite(stacked).all()):
            return None
        return float(stacked.square().sum())

    def _take_norms(self) -> torch.Tensor | None:
        """The norms taken on the device since the boundary backward began, one per
        trainable group in fp64 (consumed); None unless every group has one."""
        norms, self._norms = self._norms, None
        groups = [g for gs in self.units for g in gs if g.trainable]
        if norms is None or len(norms) != len(groups):
            return None
        return torch.stack([norms[id(g)].to(torch.float64) for g in groups])

    def write_params(self, group: FlatGroup, target: torch.Tensor) -> None:
        """The updated master of ``group`` into ``target``, its compute-dtype parameters of
        the owned range: across to the device, unless the stage-3 shard lives in host
        memory (offload_param)."""
        assert group.master is not None  # called for groups whose master is in memory
        if group.sharded and self.options.param != "none":
            target.copy_(group.master)
        else:
            self.transfers.to_device(target, group.master)

    def transfer_step(self) -> StepTransfers:
        """The copies since the last call (one step); the counters start again."""
        return self.transfers.take()

    def grad_stats(self, need_norm: bool, need_overflow: bool,
                   weighted: bool = False) -> tuple[float, float] | None:
        """Local squared norm and non-finite count (above 0 exactly when some element is
        inf/nan) from the partial norms taken on the device; None when there are none, or
        the norm is ``weighted`` per fragment (tensor parallelism): then the caller reads
        ``group.grad``."""
        return None if weighted else self.device_grad_stats(need_norm)

    def start_backward(self, boundary: bool, step_scale: float | None) -> None:
        """``step_scale``: the engine needs nothing global before the step, so a tier may
        step each unit as soon as its gradient is reduced, times ``step_scale``."""
        # stepped whole in step(), which reads the norm (fp64) unless only the guard's
        # finiteness is wanted (step_scale given: no clipping, no fp16)
        self.want_norms(boundary, torch.float32 if step_scale is not None else torch.float64)

    def group_added(self, group: FlatGroup) -> None:
        """``group``, frozen at initialize, was made trainable: its leaves were appended to
        the optimizer space (``optim_state``); attach_optimizer follows. In memory nothing
        more is needed."""
        return None

    def no_gradient(self, group: FlatGroup) -> None:
        """No gradient reached trainable ``group`` in the window's first reduction (its
        parameters frozen): the reduction is skipped, so its gradient shard must read as
        zero. An in-memory shard is, since the last step's zero_grads."""
        return None

    def on_unit_reduced(self, unit: int) -> None:
        """Every gradient shard of ``unit`` is complete."""
        return None

    def finish_unit_steps(self) -> bool:
        """Wait for steps begun during backward and for every copy in flight (the host
        gradients are complete after it); True if the tier stepped units then (all of
        them, unless :meth:`unit_step_outcome` counts refusals)."""
        self.transfers.wait()
        self.fresh_grads()
        return False

    def fresh_grads(self, groups: list[FlatGroup] | None = None) -> None:
        """Zero the gradient shards that stand for zeros (no gradient reached them since the
        last step), before the step reads them; ``groups``: those only (default: all)."""
        for g in groups if groups is not None else [g for gs in self.units for g in gs]:
            g.fresh_grad()

    # whether reduced gradients cross to host buffers (the reducer then never reduces into
    # the gradient shard directly, even where the device is the CPU)
    grads_cross: ClassVar[bool] = True

    # whether units may be stepped during backward (the reducer then spreads a non-finite
    # gradient over the whole group, so every rank refuses the same unit)
    steps_units_in_backward: ClassVar[bool] = False

    def unit_step_outcome(self) -> tuple[int, int]:
        """(units stepped, units refused for inf/nan gradients) in the last backward."""
        return 0, 0

    def agree_io_failures(self) -> bool:
        """Whether any rank lost gradient data in I/O since the last step (then the step is
        refused on every rank until a new backward); a collective where a tier does I/O
        (nvme_guard.py), called by every rank before any other collective of the step."""
        return False

    def refuse_lost_step(self) -> None:
        """Raise while a step is refused by :meth:`agree_io_failures` (no collective)."""
        return None

    def step(self, scale: float) -> None:
        """Scale the gradients by ``scale`` and step every fragment (not yet in params)."""
        if self.chunks is not None:  # 16-bit gradients, converted chunk by chunk
            step_chunks(self.optimizer, self.chunks, scale, self.optim_state.skipped_leaves)
            return
        self.optim_state.scale_grads(scale)
        self.optim_state.attach_grads()
        self.optimizer.step()

    def materialized(self, write_back: bool = False) -> AbstractContextManager[None]:
        """A context in which every master, optimizer state and shard is in memory."""
        return nullcontext()

    def close(self) -> None:
        """Stop threads and remove files."""
        self.transfers.close()

    # -- accounting ----------------------------------------------------------------------------
    @property
    def buffer_nbytes(self) -> int:
        """Host bytes of staging buffers the tier keeps besides the model states."""
        return 0

    def memory_report(self, groups: list[FlatGroup],
                      optimizer: torch.optim.Optimizer | None) -> dict:
        """Bytes at rest by category and the tier each buffer lives in (placed by the offload
        config: the host tier is a separate copy even on a CPU-only machine), plus staging
        buffers under ``offload_buffers``."""
        report: dict = {c: dict.fromkeys(TIERS, 0) for c in CATEGORIES}
        for g in groups:
            self._count_group(report, g)
        for state in optimizer.state.values() if optimizer is not None else ():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    report["optimizer_states"][self.name] += _nbytes(value)
        report["offload_buffers"] = {"device": 0, "host": self.buffer_nbytes, "nvme": 0}
        return report

    def _count_group(self, report: dict, g: FlatGroup) -> None:
        if g.sharded:
            report["params"][self.param_tier] += _nbytes(g.shard)
        else:
            report["params"]["device"] += _nbytes(g.full)
        if not g.trainable:
            return
        owned = g.owned[1] - g.owned[0]
        if g.master_is_copy:
            report["master_params"][self.name] += owned * self.master_dtype.itemsize
        if g.stage <= 1:
            report["grads"]["device"] += _nbytes(g.grad_full)
        # on the device at stages 0-1 the shard is a view of grad_full, counted above
        if g.stage >= 2 or self.name != "device":
            report["grads"][self.name] += owned * self.grad_dtype.itemsize

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
        opt, par = zc.offload_optimizer, zc.offload_param
        pin = opt.pin_memory or par.pin_memory
        return cls(optimizer=opt.device, param=par.device, optimizer_nvme_path=opt.nvme_path,
                   param_nvme_path=par.nvme_path, pin_memory=pin and _can_pin(),
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
    # set by attach / attach_optimizer, once the groups and the optimizer exist
    optim_state: ShardedOptimizerState
    optimizer: torch.optim.Optimizer

    def __init__(self, options: OffloadOptions, *, comm: Communicator, device: torch.device,
                 layout: Layout, stage: int, compute_dtype: torch.dtype,
                 grad_dtype: torch.dtype = torch.float32):
        """``grad_dtype``: the dtype of the gradient shard the tier keeps."""
        self.options = options
        self.comm = comm
        self.device = device
        self.layout = layout
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        self.units: list[list[FlatGroup]] = []
        self.chunks: list[Chunk] | None = None  # 16-bit gradients: stepped chunk by chunk

    # -- where things live (each tier says) ----------------------------------------------------
    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer (its leaves and states) runs: the host, for an offload tier."""
        return HOST

    def master_is_copy(self, compute_dtype: torch.dtype) -> bool:
        """Whether the fp32 master is its own buffer rather than the compute parameters
        (always, for an offload tier)."""
        return True

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
        if self.grad_dtype == torch.float32:
            return None
        return chunk_numel(self.options.sub_group_size)

    def shard_source(self):
        """An object that reads stage-3 shards kept out of memory (ParameterSharder)."""
        return None

    # -- wiring ------------------------------------------------------------------------------
    def attach(self, units: list[list[FlatGroup]], optim_state: ShardedOptimizerState) -> None:
        """The built groups (by unit) and the optimizer leaves over them."""
        self.units = units
        self.optim_state = optim_state

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        numel = self.split_numel()
        if numel is not None:
            self.chunks = plan_chunks(optimizer, self.optim_state.grad_views, numel)

    # -- gradients and the step ----------------------------------------------------------------
    def store_grad(self, group: FlatGroup, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient ``out`` of ``group``'s owned range into its gradient shard;
        ``accumulate`` adds to what earlier micro-steps left."""
        grad = group.grad
        assert grad is not None, "an in-memory tier keeps every gradient shard"
        if out.data_ptr() == grad.data_ptr():  # reduce-scattered in place
            return
        src = out if out.device == grad.device else out.to(grad.device)
        if accumulate:
            grad.add_(src)
        else:
            grad.copy_(src)

    def grad_stats(self, need_norm: bool, need_overflow: bool) -> tuple[float, float] | None:
        """Local squared norm and non-finite count of gradients kept out of memory; None
        when every gradient shard is a tensor (``group.grad``)."""
        return None

    def start_backward(self, boundary: bool, step_scale: float | None) -> None:
        """``step_scale``: the engine needs nothing global before the step, so a tier may
        step each unit as soon as its gradient is reduced, times ``step_scale``."""
        return None  # stepped whole in step()

    def on_unit_reduced(self, unit: int) -> None:
        """Every gradient shard of ``unit`` is complete."""
        return None

    def finish_unit_steps(self) -> bool:
        """Wait for steps begun during backward; True if the tier stepped units then (all
        of them, unless :meth:`unit_step_outcome` counts refusals)."""
        return False

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
        return None  # in memory: nothing to stop

    # -- accounting ----------------------------------------------------------------------------
    @property
    def buffer_nbytes(self) -> int:
        """Host bytes of staging buffers the tier keeps besides the model states."""
        return 0

    def memory_report(self, groups: list[FlatGroup], optimizer: torch.optim.Optimizer) -> dict:
        """Bytes at rest by category and the tier each buffer lives in (placed by the offload
        config: the host tier is a separate copy even on a CPU-only machine), plus staging
        buffers under ``offload_buffers``."""
        report: dict = {c: dict.fromkeys(TIERS, 0) for c in CATEGORIES}
        for g in groups:
            self._count_group(report, g)
        for state in optimizer.state.values():
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
            report["master_params"][self.name] += owned * 4
        if g.stage <= 1:
            report["grads"]["device"] += _nbytes(g.grad_full)
        # on the device at stages 0-1 the shard is a view of grad_full, counted above
        if g.stage >= 2 or self.name != "device":
            report["grads"][self.name] += owned * self.grad_dtype.itemsize

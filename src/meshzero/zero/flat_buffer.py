"""Flat parameter and gradient buffers of one group, and the views the module computes with.

Buffers of a group with padded size P = N*S and owned range [lo, hi):

    full     (P,)       compute dtype; the module's parameters are views into it. At stage 3
                        (non-persistent groups) its storage is freed between uses.
    shard    (S,)       compute dtype; own storage at stage 3, else a view of full[lo:hi].
    master   (hi-lo,)   fp32 truth the optimizer steps; a view of full/shard in fp32 training.
    grad     (hi-lo,)   fp32 gradient of the owned range (a view of grad_full at stages 0-1).
    grad_full (P,)      gradient accumulation buffer; persistent at stages 0-1, transient
                        (one micro-step) at stages 2-3.

With optimizer offload (zero/offload.py) master and grad are host buffers (cpu) or live in
NVMe files (nvme: master's storage is freed, grad is None and reduced gradients go to
``grad_sink``); with parameter offload the stage-3 shard is a host buffer (cpu) or a file.

The owned range is the whole buffer at stage 0 and rank r's shard at stages 1-3.
"""

from __future__ import annotations

import torch
from torch import nn

from meshzero.zero.offload import OffloadOptions, host_copy, host_zeros, placeholder
from meshzero.zero.units import GroupLayout


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it) valid."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` back its memory (uninitialised); views see the same storage again."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


class FlatGroup:
    """Runtime buffers of one :class:`GroupLayout` on this rank."""

    def __init__(
        self,
        layout: GroupLayout,
        params: list[nn.Parameter],
        *,
        stage: int,
        rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        offload: OffloadOptions | None = None,
        master_sink=None,
    ):
        """``master_sink(master)``: NVMe tier, takes the initial fp32 master of the owned
        range, which then lives only in its file."""
        offload = offload or OffloadOptions()
        self.offload = offload
        self._master_sink = master_sink
        self.layout = layout
        self.params = params
        self.stage = stage
        self.sharded = stage == 3 and not layout.persistent
        self.owned = (0, layout.padded_numel) if stage == 0 else layout.shard_range(rank)
        self.trainable = layout.requires_grad

        # fp32 copy of the initial values: the master starts exact, not rounded to bf16.
        init = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for slot, p in zip(layout.slots, params, strict=True):
                init[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        self.full = init if compute_dtype == torch.float32 else init.to(compute_dtype)
        lo, hi = layout.shard_range(rank)
        if not self.sharded:
            self.shard = self.full[lo:hi]
        elif offload.param != "none":
            self.shard = host_copy(self.full[lo:hi], offload.pin_memory)
        else:
            self.shard = self.full[lo:hi].clone()
        self.space_offset = 0  # where the owned range starts in the optimizer space
        self.grad_sink = None  # NVMe: callable(group, reduced, accumulate)
        self._master_copy = self.trainable and (compute_dtype != torch.float32
                                                or offload.optimizer != "none")

        self.master: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        if self.trainable:
            self.master = self._make_master(init, compute_dtype)
            if stage <= 1:
                self.grad_full = torch.zeros(layout.padded_numel, device=device)
                self.grad = self.grad_full[self.owned[0]:self.owned[1]]
            else:
                self.grad = torch.zeros(hi - lo, device=device)
            if offload.optimizer == "cpu":
                self.grad = host_zeros(self.owned[1] - self.owned[0], torch.float32,
                                       offload.pin_memory)
            elif offload.optimizer == "nvme":
                self.grad = None
        del init
        self._bind_params()
        if self.sharded:
            free_storage(self.full)

    @property
    def master_is_copy(self) -> bool:
        """Whether the fp32 master is its own buffer (mixed precision, offload) or the params."""
        return self._master_copy

    def _make_master(self, init: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        lo, hi = self.owned
        if self.offload.optimizer == "nvme":
            self._master_sink(init[lo:hi])
            return placeholder(hi - lo, torch.float32)
        if self.offload.optimizer != "none":
            return host_copy(init[lo:hi], self.offload.pin_memory)
        if compute_dtype == torch.float32:  # the compute params are the master: no copy
            return self.shard if self.sharded else self.full[lo:hi]
        return init[lo:hi].clone()

    def _bind_params(self) -> None:
        """Point every parameter at its slice of ``full`` (tensors stay the same objects)."""
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            p.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    # -- full parameter buffer -------------------------------------------------------------
    @property
    def full_nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def is_full_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    # -- gradients ---------------------------------------------------------------------------
    def grad_target(self) -> torch.Tensor:
        """The buffer backward accumulates into (allocated zeroed on first use at stages 2-3)."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded_numel, device=self.full.device)
        return self.grad_full

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its slice of the flat gradient buffer."""
        slot = self.layout.slots[index]
        self.grad_target()[slot.offset:slot.offset + slot.numel].add_(grad.reshape(-1))

    def take_reduced_grad(self, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient of the owned range: into ``grad`` (wherever it lives), or to
        the NVMe sink. ``accumulate`` adds to what earlier micro-steps left."""
        if self.grad_sink is not None:
            self.grad_sink(self, out, accumulate)
            return
        if out.data_ptr() == self.grad.data_ptr():  # reduce-scattered in place
            return
        src = out if out.device == self.grad.device else out.to(self.grad.device)
        if accumulate:
            self.grad.add_(src)
        else:
            self.grad.copy_(src)

    def drop_transient_grad(self) -> None:
        if self.stage >= 2:
            self.grad_full = None

    def zero_grad(self) -> None:
        if self.grad_full is not None:
            self.grad_full.zero_()
        if self.grad is not None:
            self.grad.zero_()

    # -- after the optimizer step -------------------------------------------------------------
    def copy_master_to_params(self) -> None:
        """Write the updated fp32 master into the compute-dtype parameters of the owned range."""
        if self.master is None or self.master.untyped_storage().nbytes() == 0:
            return  # no master, or the master is in an NVMe file (the store writes params)
        lo, hi = self.owned
        target = self.shard if self.sharded else self.full[lo:hi]
        if target.data_ptr() != self.master.data_ptr():
            target.copy_(self.master)

    @property
    def needs_param_all_gather(self) -> bool:
        """Stages 1-3 with resident full params: the updated shards must be all-gathered."""
        return self.trainable and self.stage >= 1 and not self.sharded

"""Flat parameter and gradient buffers of one group, and the views the module computes with.

Buffers of a group with padded size P = N*S and owned range [lo, hi):

    full     (P,)       compute dtype; the module's parameters are views into it. At stage 3
                        (non-persistent groups) its storage is freed between uses.
    shard    (S,)       compute dtype; own storage at stage 3, else a view of full[lo:hi].
    master   (hi-lo,)   fp32 truth the optimizer steps; a view of full/shard in fp32 training.
    grad     (hi-lo,)   gradient of the owned range (a view of grad_full at stages 0-1).
    grad_full (P,)      gradient accumulation buffer; persistent at stages 0-1, transient
                        (one micro-step) at stages 2-3. The transient one is taken
                        uninitialised (from a :class:`TransientPool` when one is attached):
                        a parameter's first gradient is copied in, later ones added, and
                        what no gradient reached (unused parameters, padding) is zeroed only
                        when the buffer is reduced: no zero-fill pass, and no fresh pages
                        per unit per step when the pool has a buffer of the size.

Both gradient buffers are in the tier's gradient dtype (data_types.grad_accum_dtype: by
default the compute dtype, so bf16 training holds the ZeRO paper's 2-byte gradients).

Where master, grad and the stage-3 shard live is the tier's decision (zero/offload/): on the
device, in host buffers, or in files (then master's storage is empty, grad is None and the
tier takes the reduced gradients).

The owned range is the whole buffer at stage 0 and rank r's shard at stages 1-3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshzero.zero.units import GroupLayout

if TYPE_CHECKING:
    from meshzero.zero.offload import Tier


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it) valid."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` back its memory (uninitialised); views see the same storage again."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


class TransientPool:
    """Released transient gradient buffers, by (numel, dtype, device), for the next unit of
    the same size in the same backward (cleared at its end: nothing is held at rest)."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        spare = self.free.get((numel, dtype, device))
        return spare.pop() if spare else torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        self.free.setdefault((t.numel(), t.dtype, t.device), []).append(t)

    def clear(self) -> None:
        self.free.clear()


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
        tier: Tier,
        init: torch.Tensor | None = None,
        trains: bool = True,
    ):
        """``tier``: where the master, the gradient shard and the stage-3 shard live.
        ``init``: the group's fp32 values, already laid out (padded_numel,) on ``device``
        (zero_init materialises parameters in place); parameters not in it are copied in.
        ``trains`` False: an engine without an optimizer, no group gets a master or
        gradients whatever ``requires_grad`` says."""
        self.tier = tier
        self.layout = layout
        self.params = params
        self.stage = stage
        self.sharded = stage == 3 and not layout.persistent
        self.owned = (0, layout.padded_numel) if stage == 0 else layout.shard_range(rank)

        # fp32 copy of the initial values: the master starts exact, not rounded to bf16.
        if init is None:
            init = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for slot, p in zip(layout.slots, params, strict=True):
                dst = init[slot.offset:slot.offset + slot.numel]
                if p.data_ptr() != dst.data_ptr():  # not materialised in place
                    dst.copy_(p.detach().reshape(-1))
        self.full = init if compute_dtype == torch.float32 else init.to(compute_dtype)
        lo, hi = layout.shard_range(rank)
        self.shard = tier.param_shard(self.full[lo:hi]) if self.sharded else self.full[lo:hi]
        self.space_offset = 0  # where the owned range starts in the optimizer space
        self._compute_dtype = compute_dtype
        self._master_copy = False

        self.master: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        # a host gradient shard that stands for zeros (zero_grad): the next store overwrites
        self.grad_stale = False
        self.grad_full: torch.Tensor | None = None
        self.transient_pool: TransientPool | None = None  # set by the gradient reducer
        self._written: list[bool] | None = None  # transient buffer: slots holding a gradient
        self.trainable = False
        if layout.requires_grad and trains:
            self.make_trainable(init[self.owned[0]:self.owned[1]])
        del init
        self._bind_params()
        if self.sharded:
            free_storage(self.full)

    def make_trainable(self, init: torch.Tensor | None = None) -> None:
        """Give the group its fp32 master, gradient buffers and optimizer side: at build for
        a trainable group, or later for a group frozen at initialize when one of its
        parameters is unfrozen (zero/trainability.py). ``init``: the owned range's exact
        fp32 values; None takes them from the compute parameters (a frozen group keeps no
        fp32 copy: in 16-bit training the master starts from the 16-bit values)."""
        assert not self.trainable, "make_trainable on a group that is trainable already"
        if init is None:
            init = self.tier.owned_values(self).float()
            if init.device != self.full.device:  # a stage-3 shard offloaded to host memory
                init = init.to(self.full.device)
        self.trainable = True
        self._master_copy = self.tier.master_is_copy(self._compute_dtype)
        self.master = self.tier.master(self, init)
        if self.stage <= 1:  # the accumulation buffer persists over micro-steps
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=self.tier.grad_dtype,
                                         device=self.full.device)
        self.grad = self.tier.grad_shard(self)

    @property
    def master_is_copy(self) -> bool:
        """Whether the fp32 master is its own buffer (mixed precision, offload) or the params."""
        return self._master_copy

    def owned_params(self) -> torch.Tensor:
        """The compute-dtype parameters of the owned range (the shard at stage 3)."""
        lo, hi = self.owned
        return self.shard if self.sharded else self.full[lo:hi]

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
        """The complete gradient buffer, to reduce (stages 2-3: a transient buffer, with what
        no gradient reached zeroed now; all zeros if none did)."""
        full = self._grad_buffer()
        written = self._written
        if written is not None:
            self._written = None
            with torch.no_grad():
                end = 0
                for slot, done in zip(self.layout.slots, written, strict=True):
                    if not done:
                        full[slot.offset:slot.offset + slot.numel].zero_()
                    end = slot.offset + slot.numel
                full[end:].zero_()  # padding
        return full

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_full is None:  # stages 2-3: transient, uninitialised
            n, device = self.layout.padded_numel, self.full.device
            pool = self.transient_pool
            self.grad_full = (pool.take(n, self.tier.grad_dtype, device) if pool is not None
                              else torch.empty(n, dtype=self.tier.grad_dtype, device=device))
            self._written = [False] * len(self.layout.slots)
        return self.grad_full

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its slice of the flat gradient buffer (copy it
        there if it is the first since the transient buffer was taken)."""
        slot = self.layout.slots[index]
        part = self._grad_buffer()[slot.offset:slot.offset + slot.numel]
        written = self._written
        if written is not None and not written[index]:
            part.copy_(grad.reshape(-1))
            written[index] = True
        else:
            part.add_(grad.reshape(-1))

    def take_reduced_grad(self, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient of the owned range, to wherever the tier keeps it.
        ``accumulate`` adds to what earlier micro-steps left."""
        self.tier.store_grad(self, out, accumulate)

    def drop_transient_grad(self) -> None:
        if self.stage >= 2:
            if self.grad_full is not None and self.transient_pool is not None:
                self.transient_pool.give(self.grad_full)
            self.grad_full = None
            self._written = None

    def zero_grad(self) -> None:
        if self.grad_full is not None:
            self.grad_full.zero_()
            self._written = None  # all of it zero now: later gradients add
        if self.grad is None:
            return
        if self.tier.grads_cross:
            # a gradient shard in host memory is not zeroed now (a pass over host memory:
            # 66 ms per step for 1.28 B parameters on the H200's host) but marked: the next
            # reduction overwrites it instead of adding (Tier.store_grad), and a reader zeroes
            # it first if none came (fresh_grad: a unit frozen for the whole window)
            self.grad_stale = True
        else:
            self.grad.zero_()

    def fresh_grad(self) -> None:
        """Before the gradient shard is read: zeros, if it stands for zeros (no copy is in
        flight into a stale shard: none was stored since it was marked)."""
        if self.grad_stale:
            assert self.grad is not None  # marked only where the group holds its shard
            self.grad.zero_()
            self.grad_stale = False

    # -- after the optimizer step -------------------------------------------------------------
    def copy_master_to_params(self) -> None:
        """Write the updated fp32 master into the compute-dtype parameters of the owned range."""
        if self.master is None or self.master.untyped_storage().nbytes() == 0:
            return  # no master, or the tier keeps it out of memory (and writes the params)
        target = self.owned_params()
        if target.data_ptr() != self.master.data_ptr():
            self.tier.write_params(self, target)  # across to the device when offloaded

    @property
    def needs_param_all_gather(self) -> bool:
        """Stages 1-3 with resident full params: the updated shards must be all-gathered."""
        return self.trainable and self.stage >= 1 and not self.sharded

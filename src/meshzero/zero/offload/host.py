"""The host tier (``offload_optimizer.device = cpu``).

The fp32 master, its gradient shard and the optimizer states of this rank live in host
memory and the fused CPU kernel steps them. When nothing needs the global gradient first (no
clipping, no fp16 overflow check) each unit is stepped on a worker thread as soon as its
gradient shard has been reduced and has landed in host memory, while backward goes on with
the remaining units (:class:`UnitStepper`); otherwise the whole step runs in ``engine.step()``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from meshzero.zero.grad_scan import scan_grads
from meshzero.zero.offload.stepping import (
    Chunk,
    plan_chunks,
    step_chunks,
    step_subset,
    subsets_by_group,
)
from meshzero.zero.offload.tier import Tier, elementwise, host_copy, host_zeros
from meshzero.zero.offload.transfer import UnitStepper

__all__ = ["HostTier", "UnitStepper"]

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup


class HostTier(Tier):
    name = "host"
    steps_units_in_backward = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the transfers' worker: a unit's step runs after its gradient has landed
        self.stepper = self.transfers.worker
        self._step_scale: float | None = None
        self._unit_subsets: dict[int, list[list[torch.Tensor]]] = {}
        # units stepped / refused (inf/nan gradient: that one and all after it) in backward
        self._stepped, self._refused = 0, 0
        self._unit_chunks: dict[int, list[Chunk]] = {}

    def master(self, group: FlatGroup, init: torch.Tensor) -> torch.Tensor:
        return host_copy(init, self.options.pin_memory, self.master_dtype)

    def grad_shard(self, group: FlatGroup) -> torch.Tensor | None:
        lo, hi = group.owned
        return host_zeros(hi - lo, self.grad_dtype, self.options.pin_memory)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Each unit's leaves by param group, once (a unit step passes them to step_subset);
        with 16-bit gradients, each unit's chunks (stepping.py)."""
        super().attach_optimizer(optimizer)
        unit_of = {id(g): u for u, gs in enumerate(self.units) for g in gs}
        pairs = defaultdict(list)
        for (leaf, _, g), (_, grad) in zip(self.optim_state.fragment_index,
                                           self.optim_state.grad_views, strict=True):
            pairs[unit_of[id(g)]].append((leaf, grad))
        self._unit_subsets = {u: subsets_by_group(optimizer, [leaf for leaf, _ in ps])
                              for u, ps in pairs.items()}
        numel = self.split_numel()
        if numel is not None:
            self._unit_chunks = {u: plan_chunks(optimizer, ps, numel) for u, ps in pairs.items()}

    # -- units stepped during backward -----------------------------------------------------------
    def start_backward(self, boundary: bool, step_scale: float | None) -> None:
        if boundary and step_scale is not None and self._step_scale is not None:
            # the last boundary backward stepped its units already (step() not called yet)
            raise ValueError(
                "a second engine.backward() on the accumulation boundary before "
                "engine.step(): with offload_optimizer cpu each unit is stepped during the "
                "boundary backward, so its gradients are final then; call backward once per "
                "micro-step, or set engine.overlap_offload_step = False")
        if not elementwise(self.optimizer):  # a step needs every unit's gradients
            step_scale = None
        self._step_scale = step_scale if boundary else None
        # norms taken on the device as gradients are stored: the whole step's in fp64 when
        # it runs in step() (clipping, fp16), else each unit's finiteness for its step here
        self.want_norms(boundary, torch.float64 if step_scale is None else torch.float32)
        if boundary:
            self._stepped, self._refused = 0, 0

    def on_unit_reduced(self, unit: int) -> None:
        scale = self._step_scale
        if scale is not None and unit in self._unit_subsets:
            self.stepper.submit(lambda: self._step_unit(unit, scale))

    def _step_unit(self, unit: int, scale: float) -> None:
        """On the worker thread: step one unit's fragments and copy the result into its
        compute parameters while backward goes on."""
        with torch.no_grad():
            groups = [g for g in self.units[unit] if g.trainable]
            self.fresh_grads(groups)
            # never write inf/nan into the master: the engine agrees on the refusal
            if self._refused or self._nonfinite(groups):
                self._refused += 1
                return
            skipped = self.optim_state.skipped_leaves  # no gradient this step
            if unit in self._unit_chunks:  # 16-bit gradients: scaled as they are converted
                step_chunks(self.optimizer, self._unit_chunks[unit], scale, skipped)
            else:
                for g in groups if scale != 1.0 else ():
                    assert g.grad is not None  # a trainable group holds its gradient shard
                    g.grad.mul_(scale)
                step_subset(self.optimizer, self._unit_subsets[unit], skipped)
            for g in groups:
                g.copy_master_to_params()
            self._stepped += 1

    def _nonfinite(self, groups: list[FlatGroup]) -> bool:
        """Whether a gradient of ``groups`` (one unit's) has inf/nan: from the norms taken
        on the device before the gradients crossed (no pass over host memory), or, when
        one is missing or not finite (an fp32 norm of finite values may overflow), from
        the exact host scan."""
        norms = self._norms or {}
        taken = [norms[id(g)] for g in groups if id(g) in norms]
        if taken and len(taken) == len(groups):
            # read on the copy stream, which took the gradients after their norms: reading
            # on this thread's (default) stream would wait for all of backward queued so far
            with self.transfers.on_copy_stream():
                if bool(torch.isfinite(torch.stack(taken)).all()):
                    return False
        grads = [g.grad for g in groups if g.grad is not None]
        return bool(grads) and scan_grads(grads, need_norm=False)[1].item() > 0

    def finish_unit_steps(self) -> bool:
        stepped = self._step_scale is not None
        self._step_scale = None
        self.transfers.wait()  # the unit steps, then every copy
        self.fresh_grads()
        self.transfers.join_compute()  # compute reads the parameters the steps wrote
        return stepped

    def unit_step_outcome(self) -> tuple[int, int]:
        return self._stepped, self._refused

    def close(self) -> None:
        self.transfers.close()

"""The host tier (``offload_optimizer.device = cpu``).

The fp32 master, its gradient shard and the optimizer states of this rank live in host
memory and the fused CPU kernel steps them. When nothing needs the global gradient first (no
clipping, no fp16 overflow check) each unit is stepped on a worker thread as soon as its
gradient shard has been reduced, while backward goes on with the remaining units
(:class:`UnitStepper`); otherwise the whole step runs in ``engine.step()``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.tier import Tier, host_copy, host_zeros

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup


# -- stepping part of an optimizer --------------------------------------------------------------
def step_subset(optimizer: torch.optim.Optimizer, subset: list[list[torch.Tensor]]) -> None:
    """``optimizer.step()`` over ``subset[i]`` of param group i only (elementwise optimizers
    give each tensor the same update as a step over all of them)."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, subset, strict=True):
            group["params"] = params
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


def subsets_by_group(optimizer: torch.optim.Optimizer,
                     leaves: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``leaves`` split by the optimizer's param groups, in each group's own order."""
    wanted = {id(t) for t in leaves}
    return [[p for p in g["params"] if id(p) in wanted] for g in optimizer.param_groups]


class UnitStepper:
    """Steps units on one worker thread while backward continues (host tier)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshzero-step")
        self._futures.append(self._pool.submit(fn))

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def wait(self) -> None:
        """Wait for every submitted unit step; re-raise the first error."""
        futures, self._futures = self._futures, []
        error = None
        for f in futures:
            exc = f.exception()
            error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class HostTier(Tier):
    name = "host"
    steps_units_in_backward = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stepper = UnitStepper()
        self._step_scale: float | None = None
        self._unit_subsets: dict[int, list[list[torch.Tensor]]] = {}
        # units stepped / refused (inf/nan gradient: that one and all after it) in backward
        self._stepped, self._refused = 0, 0

    def master(self, group: FlatGroup, init: torch.Tensor) -> torch.Tensor:
        return host_copy(init, self.options.pin_memory)

    def grad_shard(self, group: FlatGroup) -> torch.Tensor | None:
        lo, hi = group.owned
        return host_zeros(hi - lo, self.grad_dtype, self.options.pin_memory)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Each unit's leaves by param group, once (a unit step passes them to step_subset)."""
        super().attach_optimizer(optimizer)
        unit_of = {id(g): u for u, gs in enumerate(self.units) for g in gs}
        leaves = defaultdict(list)
        for leaf, _, g in self.optim_state.fragment_index:
            leaves[unit_of[id(g)]].append(leaf)
        self._unit_subsets = {u: subsets_by_group(optimizer, ls) for u, ls in leaves.items()}

    # -- units stepped during backward -----------------------------------------------------------
    def start_backward(self, boundary: bool, step_scale: float | None) -> None:
        if boundary and step_scale is not None and self._step_scale is not None:
            # the last boundary backward stepped its units already (step() not called yet)
            raise ValueError(
                "a second engine.backward() on the accumulation boundary before "
                "engine.step(): with offload_optimizer cpu each unit is stepped during the "
                "boundary backward, so its gradients are final then; call backward once per "
                "micro-step, or set engine.overlap_offload_step = False")
        self._step_scale = step_scale if boundary else None
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
            # never write inf/nan into the master: the engine agrees on the refusal
            if self._refused or not all(bool(torch.isfinite(g.grad).all()) for g in groups
                                        if g.grad is not None):
                self._refused += 1
                return
            if scale != 1.0:
                for g in groups:
                    assert g.grad is not None  # a trainable group holds its gradient shard
                    g.grad.mul_(scale)
            step_subset(self.optimizer, self._unit_subsets[unit])
            for g in groups:
                g.copy_master_to_params()
            self._stepped += 1

    def finish_unit_steps(self) -> bool:
        stepped = self._step_scale is not None
        self._step_scale = None
        self.stepper.wait()
        return stepped

    def unit_step_outcome(self) -> tuple[int, int]:
        return self._stepped, self._refused

    def close(self) -> None:
        self.stepper.close()

"""Gradient reduction that overlaps backward.

Each trainable parameter gets a post-accumulate-grad hook that adds its gradient into its
group's flat fp32 buffer and drops ``param.grad``. When every trainable parameter of a unit
has reported, the unit is *ready*. Ready units are reduced in one fixed order (reverse unit
index, i.e. roughly backward order) so every rank issues the same collectives in the same
order even if readiness differs; ``finish_backward`` reduces whatever never became ready
(unused parameters reduce as zeros, never a hang) and waits for everything in flight.

Per stage, for a group of padded size P and shard S:
    stage 0: all-reduce grad_full (P,) on the accumulation boundary only
    stage 1: reduce-scatter grad_full (P,) -> grad (S,) on the boundary only
    stage 2/3: reduce-scatter the transient grad_full (P,) -> += grad (S,) every micro-step
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from meshzero.comm import Communicator, Handle
from meshzero.zero.flat_buffer import FlatGroup, TransientPool
from meshzero.zero.quantized_grads import HierarchicalReduceScatter, TwoHops


class GradientReducer:
    def __init__(
        self,
        units: list[list[FlatGroup]],
        comm: Communicator,
        *,
        stage: int,
        comm_dtype: torch.dtype,
        bucket_numel: int,
        on_unit_ready: Callable[[int], None] | None = None,
        on_unit_reduced: Callable[[int], None] | None = None,
        replica_comm: Communicator | None = None,
        predivide: float = 1.0,
        grad_reduce: HierarchicalReduceScatter | None = None,
    ):
        """``replica_comm`` (MiCS): after the reduce-scatter inside the shard block, the
        gradient shard is all-reduced across the blocks that replicate it. ``predivide``:
        gradients are multiplied by 1 / predivide before they are summed (DeepSpeed's
        prescale_gradients and gradient_predivide_factor, which keep 16-bit sums in range).
        ``grad_reduce`` (ZeRO++ qgZ): the reduce-scatters go by its two hops, the one across
        nodes quantized (zero/quantized_grads.py), instead of over ``comm``."""
        self.units = units
        self.comm = comm
        self.stage = stage
        self.comm_dtype = comm_dtype
        self.bucket_numel = bucket_numel
        self.on_unit_ready = on_unit_ready
        self.on_unit_reduced = on_unit_reduced
        self.replica_comm = replica_comm
        self.predivide = predivide
        self.scatter: Communicator | HierarchicalReduceScatter = grad_reduce or comm
        self._count_trainable()
        # frozen now (requires_grad False): no gradient comes; a unit whose parameters are
        # all frozen in this backward (``expected`` 0) has nothing new to reduce, and at
        # stages 0-1 one that got nothing in the whole window neither (``touched``)
        self.expected = list(self.num_trainable)
        self.touched = [True] * len(units)
        self.frozen: frozenset[int] = frozenset()
        self.inflight: deque[tuple[Handle | TwoHops, Callable[[], object], int]] = deque()
        self.grads_are_zero = True
        self.enabled = True  # False: leave gradients in param.grad (a pipeline schedule)
        # stage 0, True: each rank keeps its own gradient, scaled to read as the sum (the
        # step's 1 / N undoes it), for an optimizer that sends its momentum instead (1-bit)
        self.local_gradients = False
        # True while units are stepped during backward: a group with any inf/nan is sent as
        # all NaN, so every rank's shard of it shows the fault (faults/nonfinite.py)
        self.spread_nonfinite = False
        self._reduce_now = False
        self.in_backward = False  # between begin_backward and finish_backward
        self._set_aside: list[tuple[FlatGroup, torch.Tensor]] = []
        self._add_to_reduced: set[int] = set()
        # stages 2-3: a unit's transient gradient buffer goes back to the pool once reduced,
        # for the next unit of the same size (fewer fresh pages per step)
        self.pool = _shared_pool(units)
        self._reset()
        self._hooks: list = []
        # (unit, group, index) of trainable parameters not hooked yet: torch hooks only a
        # tensor that requires grad, so a frozen one is hooked when it is unfrozen
        self._unhooked = [(u, g, i) for u, groups in enumerate(units) for g in groups
                          if g.trainable for i in range(len(g.params))]
        self._hook_unfrozen()

    def _hook_unfrozen(self) -> None:
        waiting = []
        for unit, group, i in self._unhooked:
            p = group.params[i]
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._make_hook(unit, group, i)))
            else:
                waiting.append((unit, group, i))
        self._unhooked = waiting

    def _count_trainable(self) -> None:
        self.num_groups = [sum(1 for g in gs if g.trainable) for gs in self.units]
        self.num_trainable = [sum(len(g.params) for g in gs if g.trainable) for gs in self.units]
        self.order = [u for u in reversed(range(len(self.units))) if self.num_trainable[u] > 0]

    def add_group(self, unit: int, group: FlatGroup) -> None:
        """A group of ``unit`` made trainable after initialize: hook its parameters."""
        self._count_trainable()
        self._unhooked.extend((unit, group, i) for i in range(len(group.params)))
        self._hook_unfrozen()
        self.expected = list(self.num_trainable)
        self.touched = [True] * len(self.units)
        self._reset()

    def set_frozen(self, frozen: frozenset[int], window_start: bool) -> None:
        """Before a backward: ``frozen`` the ids of trainable-group parameters with
        requires_grad False now (the same on every rank: the skip decisions below need no
        communication); ``window_start``: the first backward since the gradients were
        zeroed."""
        if self._unhooked:
            self._hook_unfrozen()
        self.frozen = frozen
        if frozen:
            self.expected = [sum(1 for g in gs if g.trainable for p in g.params
                                 if id(p) not in frozen) for gs in self.units]
        elif self.expected != self.num_trainable:
            self.expected = list(self.num_trainable)
        if window_start:
            self.touched = [e > 0 for e in self.expected]
        else:
            self.touched = [t or e > 0 for t, e in zip(self.touched, self.expected, strict=True)]
        self._reset()

    def _reset(self) -> None:
        self.remaining = list(self.expected)
        self.unreduced = list(self.num_groups)
        # nothing to wait for in a unit with no gradient coming (ready without releasing it:
        # backward may still run through its frozen parameters)
        self.ready = [e == 0 for e in self.expected]
        self.next_pos = 0

    def _make_hook(self, unit: int, group: FlatGroup, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if not self.in_backward or id(param) in self.frozen:
                # another engine's backward (a GAN's generator loss runs through the
                # discriminator): not this engine's gradient, dropped as the discriminator
                # optimizer's zero_grad() would before its own backward. Or frozen when the
                # backward began, after a forward that recorded its gradient: no gradient
                param.grad = None
                return
            assert param.grad is not None  # the hook runs after the gradient is accumulated
            if self.remaining[unit] == self.expected[unit]:
                self._finish_completed()  # the unit's first gradient: free buffers first
            with torch.no_grad():
                group.accumulate(index, param.grad)
            param.grad = None
            self.remaining[unit] -= 1
            if self.remaining[unit] == 0:
                self._unit_ready(unit)

        return hook

    def begin_backward(self, boundary: bool) -> None:
        """Stages 0-1 reduce only on the accumulation boundary; stages 2-3 every micro-step."""
        self._reduce_now = boundary or self.stage >= 2
        self.in_backward = True
        if self._reduce_now and self.stage <= 1 and not self.grads_are_zero:
            self._set_aside_reduced()

    def _set_aside_reduced(self) -> None:
        """A second backward on the boundary (two ``backward`` calls before one ``step``):
        stages 0-1 reduce ``grad_full`` itself, which now holds the already reduced sum (or,
        at stage 1, its own shard of it). Reducing it again would count it N times: keep the
        reduced part aside, reduce only the new gradients, and add them up after."""
        with torch.no_grad():
            for groups in self.units:
                for g in groups:
                    if not g.trainable:
                        continue
                    grad, full = g.grad, g.grad_full
                    assert full is not None  # a trainable group has its flat gradient
                    if grad is not None and (grad.untyped_storage().data_ptr()
                                             == full.untyped_storage().data_ptr()):
                        self._set_aside.append((g, grad.clone()))
                    else:  # a separate (offloaded) gradient: the new sum is added to it
                        self._add_to_reduced.add(id(g))
                    full.zero_()

    def _unit_ready(self, unit: int) -> None:
        self.ready[unit] = True
        if self.on_unit_ready is not None:
            self.on_unit_ready(unit)
        if not self._reduce_now:
            return
        while self.next_pos < len(self.order) and self.ready[self.order[self.next_pos]]:
            self._launch(self.order[self.next_pos])
            self.next_pos += 1

    def reduce_param_grads(self) -> None:
        """Move every ``param.grad`` (accumulated with the hooks off) into the flat buffers
        and reduce all units, as at the end of a boundary backward."""
        with torch.no_grad():
            for groups in self.units:
                for group in groups:
                    if not group.trainable:
                        continue
                    for i, p in enumerate(group.params):
                        if p.grad is not None:
                            group.accumulate(i, p.grad)
                            p.grad = None
        self.begin_backward(True)
        self.finish_backward()

    def finish_backward(self) -> None:
        """Reduce units that never became ready (unused params) and wait for all reductions."""
        if self._reduce_now:
            for u in self.order[self.next_pos:]:
                self._launch(u)
            self.grads_are_zero = False
            if self.local_gradients:
                self._agree_nonfinite()
        self.drain()
        with torch.no_grad():
            for g, reduced in self._set_aside:
                assert g.grad is not None  # set aside only where the group had its gradient
                g.grad.add_(reduced)
        self._set_aside.clear()
        self._add_to_reduced.clear()
        self.pool.clear()
        self._reset()
        self.in_backward = False

    def _agree_nonfinite(self) -> None:
        """Local gradients: an inf/nan on one rank is made every rank's (all NaN), so that
        the step's check, which reads the local gradient at stage 0, skips the step on all
        ranks alike (one 4-byte all-reduce, ``nonfinite_check``)."""
        grads = [g.grad_full for gs in self.units for g in gs
                 if g.trainable and g.grad_full is not None]
        with torch.no_grad():
            flag = torch.zeros(1, device=grads[0].device if grads else None)
            for grad in grads:
                flag += (~torch.isfinite(grad)).any().float()
            self.comm.all_reduce(flag, name="nonfinite_check").wait()
            if flag.item() > 0:
                for grad in grads:
                    grad.fill_(float("nan"))

    def _finish_completed(self) -> None:
        """Finish the reductions at the head of the queue that are already done (no wait).
        Not with a replica group (MiCS): a finish then waits on an all-reduce over another
        group, and finishing whenever a poll happens to see completion would put that wait
        at a point that differs between ranks (a wait cycle with the stage-3 order check of
        the shard group); those finish at the fixed points (bucket cap, drain)."""
        if self.replica_comm is not None:
            return
        while self.inflight and self.inflight[0][0].completed():
            self._finish_oldest()

    def drain(self) -> None:
        while self.inflight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        handle, finish, _ = self.inflight.popleft()
        handle.wait()
        with torch.no_grad():
            finish()

    def _launch(self, unit: int) -> None:
        if not self.touched[unit] if self.stage <= 1 else self.expected[unit] == 0:
            # no gradient reached the unit (its parameters frozen): nothing to sum. In the
            # window's first reduction its gradient shards must then read as zero (the
            # NVMe tier's file still holds the last step's)
            if self.grads_are_zero:
                for group in self.units[unit]:
                    if group.trainable:
                        group.tier.no_gradient(group)
            self.unreduced[unit] = 1
            self._reduced(unit)
            return
        for group in self.units[unit]:
            if not group.trainable:
                continue
            if self.local_gradients:
                assert self.stage == 0, "local gradients are a stage-0 mode"
                with torch.no_grad():
                    group.grad_target().mul_(self.comm.size / self.predivide)
                continue
            numel = group.layout.padded_numel
            while self.inflight and sum(n for *_, n in self.inflight) + numel > self.bucket_numel:
                self._finish_oldest()
            with torch.no_grad():
                handle, finish = self._reduce(group, unit)
            self.inflight.append((handle, finish, numel))

    def _reduced(self, unit: int) -> None:
        self.unreduced[unit] -= 1
        if self.unreduced[unit] == 0 and self.on_unit_reduced is not None:
            self.on_unit_reduced(unit)

    def _reduce(self, group: FlatGroup, unit: int
                ) -> tuple[Handle | TwoHops, Callable[[], object]]:
        src = group.grad_target()
        send = src if self.comm_dtype == src.dtype else src.to(self.comm_dtype)
        if self.predivide != 1.0:  # never in place on src: it may be read after the reduction
            send = send * (1.0 / self.predivide) if send is src else send.mul_(1.0 / self.predivide)
        if self.spread_nonfinite:
            send.masked_fill_(~torch.isfinite(send).all(), float("nan"))  # no host sync
        if self.stage == 0:
            reduced = self.comm.all_reduce(send)
            return reduced, (lambda: src.copy_(send)) if send is not src else (lambda: None)
        # into the gradient shard itself when it is on the device (an offload tier takes
        # ``out`` across to its host buffer: tier.store_grad)
        direct = (self.stage >= 2 and self.grads_are_zero and group.grad is not None
                  and not group.tier.grads_cross
                  and send.dtype == group.grad.dtype and send.device == group.grad.device)
        out = (group.grad if direct and group.grad is not None
               else torch.empty_like(send[: group.layout.shard_numel]))
        # gloo on CPU receives every rank's slice for this rank into a buffer of send's size
        work = (self.pool.take(send.numel(), send.dtype, send.device)
                if self.scatter.reduces_by_all_to_all(send) else None)
        handle = self.scatter.reduce_scatter(out, send, work)
        accumulate = (self.stage >= 2 and not self.grads_are_zero) or \
            id(group) in self._add_to_reduced

        def finish() -> None:
            if self.replica_comm is not None:
                self.replica_comm.all_reduce(out).wait()
            group.take_reduced_grad(out, accumulate)
            group.drop_transient_grad()
            if work is not None:
                self.pool.give(work)
            self._reduced(unit)

        return handle, finish

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _shared_pool(units: list[list[FlatGroup]]) -> TransientPool:
    """One pool of transient gradient buffers that every group of ``units`` draws from."""
    pool = TransientPool()
    for groups in units:
        for g in groups:
            g.transient_pool = pool
    return pool

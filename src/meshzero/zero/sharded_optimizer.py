"""The optimizer side of ZeRO: fp32 master fragments, global-norm clipping, overflow checks
and writing the updated shards back into the compute parameters.

For every fragment (the part of a parameter inside this rank's owned range) we make a leaf
tensor that *views* the flat master, with ``.grad`` viewing the flat gradient, so any
``torch.optim`` optimizer steps the shard in place without knowing about sharding. A
16-bit gradient cannot be an fp32 leaf's ``.grad``: then fragments are cut into leaves of at
most the tier's ``split_numel()`` and the tier steps them on converted chunks
(zero/offload/stepping.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from meshzero.comm import Communicator, Handle
from meshzero.optimizers import FragmentNorms
from meshzero.zero.flat_buffer import FlatGroup
from meshzero.zero.grad_scan import scan_grads
from meshzero.zero.offload import Tier
from meshzero.zero.offload.stepping import split_fragment
from meshzero.zero.offload.tier import placeholder
from meshzero.zero.units import Fragment


class ShardedOptimizerState:
    """Master fragments of every trainable group and the step-time arithmetic on them."""

    def __init__(self, groups: list[FlatGroup], comm: Communicator, *, stage: int,
                 allgather_bucket_numel: int, tier: Tier):
        """``tier``: where master, gradients and states live; a tier that steps tiles out of
        memory gives a planner, and then fragments are cut where tiles begin and the leaves
        hold no memory between steps."""
        self.groups = groups
        self.tier = tier
        self.comm = comm
        self.stage = stage
        self.allgather_bucket_numel = allgather_bucket_numel
        # original parameter -> its fragments on this rank (possibly none)
        self.fragments: dict[nn.Parameter, list[nn.Parameter]] = {}
        # every fragment leaf with where it lives: (leaf, Fragment, its FlatGroup)
        self.fragment_index: list[tuple[nn.Parameter, Fragment, FlatGroup]] = []
        # (leaf, its gradient view) of every resident leaf, in fragment_index order
        self.grad_views: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._view_weights: list[float] | None = None  # tp/pp norm weight of each view
        self.space_numel = 0  # elements of this rank's optimizer space (owned ranges)
        self.tiles = tier.tile_planner()
        self._split = tier.split_numel()
        self.tile_of: list[int] = []  # tiled: the tile of each fragment_index entry
        self.leaf_params: list[nn.Parameter] = []  # the parameter of each fragment_index entry
        # leaves of parameters that got no gradient in this accumulation window: the step
        # leaves their .grad None, so torch.optim skips them (zero/trainability.py)
        self.skipped_leaves: frozenset[int] = frozenset()
        for group in groups:
            if group.trainable:
                self.add_group(group)

    def add_group(self, group: FlatGroup) -> dict[nn.Parameter, list[nn.Parameter]]:
        """Leaves over ``group``'s owned range, appended to the optimizer space (at build,
        or for a frozen group made trainable later); returns them by parameter."""
        lo, hi = group.owned
        group.space_offset = self.space_numel
        self.space_numel += hi - lo
        param_of = dict(zip(group.layout.slots, group.params, strict=True))
        first = len(self.fragment_index)
        for whole in group.layout.fragments(lo, hi):
            if self.tiles is None:
                for frag in split_fragment(whole, self._split):
                    self._add_leaf(frag, group, param_of[frag.slot], resident=True)
                continue
            position = group.space_offset + whole.local_offset
            for frag, tile in self.tiles.add(whole, position):
                self._add_leaf(frag, group, param_of[frag.slot], resident=False)
                self.tile_of.append(tile)
        self._view_weights = None
        added: dict[nn.Parameter, list[nn.Parameter]] = {p: [] for p in group.params}
        for p in group.params:  # a parameter with nothing in this rank's range: no leaves
            self.fragments.setdefault(p, [])
        for (leaf, _, _), p in zip(self.fragment_index[first:], self.leaf_params[first:],
                                   strict=True):
            added[p].append(leaf)
        return added

    def skip(self, params: list[nn.Parameter]) -> None:
        """The next step leaves the fragments of ``params`` alone (no gradient reached them
        in this window), as torch.optim does a parameter whose ``.grad`` is None."""
        self.skipped_leaves = frozenset(id(leaf) for p in params
                                        for leaf in self.fragments.get(p, ()))

    def steps_leaf(self, leaf: torch.Tensor) -> bool:
        return id(leaf) not in self.skipped_leaves

    def _add_leaf(self, frag: Fragment, group: FlatGroup, param: nn.Parameter,
                  resident: bool) -> None:
        a, b = frag.local_offset, frag.local_offset + frag.numel
        if resident:
            assert group.master is not None and group.grad is not None  # trainable group
            leaf = nn.Parameter(group.master[a:b], requires_grad=True)
            grad_view = group.grad[a:b]
            if grad_view.dtype == leaf.dtype:  # else the step converts it (16-bit gradients)
                leaf.grad = grad_view
            self.grad_views.append((leaf, grad_view))
        else:
            leaf = nn.Parameter(placeholder(frag.numel, torch.float32), requires_grad=True)
        self.fragments.setdefault(param, []).append(leaf)
        self.fragment_index.append((leaf, frag, group))
        self.leaf_params.append(param)

    def attach_grads(self) -> None:
        """Re-point every fragment's ``.grad`` at the flat gradient (a user's zero_grad may
        have set it to None); None for the skipped ones (:meth:`skip`)."""
        skipped = self.skipped_leaves
        for leaf, view in self.grad_views:
            if view.dtype == leaf.dtype:
                leaf.grad = view if not skipped or id(leaf) not in skipped else None

    def _trainable(self):
        return (g for g in self.groups if g.trainable)

    def reduce_grad_stats(self, *, need_norm: bool, need_overflow: bool,
                          model_parallel: list | None = None,
                          replicated_weight: dict[int, float] | None = None,
                          op: str = "all_reduce",
                          exchange: Callable[[torch.Tensor, str], None] | None = None,
                          ) -> tuple[float, bool]:
        """Squared L2 norm of all gradients and whether any is inf/nan, over every rank.

        The owned ranges of all ranks partition the model at stages 1-3 (padding is zero), so
        one all-reduce of the local sums gives the global values. At stage 0 every rank owns
        the whole, already reduced, gradient and no communication is needed.

        With tensor or pipeline parallelism the model is also split over ``model_parallel``
        communicators (tp, pp): their sums are added too, a parameter replicated over tp
        counted once (``replicated_weight``: id(original parameter) -> 1/tp). The
        all-reduces are counted under ``op``. ``exchange(stats, op)``: sums over this
        communicator's ranks instead of its all-reduce (the phase check's exchange, which
        carries the step's phase: faults/phase.py).
        """
        if not (need_norm or need_overflow):
            return 0.0, False
        device = self.comm_device()
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        outside = self.tier.grad_stats(need_norm, need_overflow, bool(replicated_weight))
        if outside is not None:  # out of memory, or partial norms taken on the device
            stats += torch.tensor(outside, dtype=torch.float64, device=device)
        elif replicated_weight:
            if self._view_weights is None:  # the weights never change: map them once
                weight = {id(leaf): replicated_weight.get(id(p), 1.0)
                          for p, leaves in self.fragments.items() for leaf in leaves}
                self._view_weights = [weight[id(leaf)] for leaf, _ in self.grad_views]
            stats += scan_grads([view for _, view in self.grad_views], self._view_weights,
                                device, need_norm)
        else:
            stats += scan_grads([g.grad for g in self._trainable()], None, device, need_norm)
        if self.stage >= 1 and exchange is not None:
            exchange(stats, op)
        elif self.stage >= 1:
            self.comm.all_reduce(stats, name=op).wait()
        for comm in model_parallel or ():
            comm.all_reduce(stats, name=op).wait()
        sq, bad = stats.tolist()
        return sq, bad > 0 or (need_norm and not math.isfinite(sq))

    def fragment_norms(self) -> FragmentNorms:
        """For an optimizer that needs whole-parameter norms (LAMB): each leaf's parameter,
        numbered in group order (the same on every rank, whatever fragments it holds), and
        a sum over the shard ranks. At stage 0 every rank holds whole parameters: no sum."""
        whole = {id(p): i for i, p in enumerate(p for g in self._trainable() for p in g.params)}
        whole_of = {id(leaf): whole[id(p)] for p, leaves in self.fragments.items()
                    for leaf in leaves}
        device = self.comm_device()

        def all_reduce(t: torch.Tensor) -> None:
            if self.stage == 0:
                return
            moved = t.to(device)  # the tier may step on the host, the group reduce elsewhere
            self.comm.all_reduce(moved, name="optimizer_norms").wait()
            if moved is not t:
                t.copy_(moved)

        return FragmentNorms(whole_of, len(whole), all_reduce)

    def comm_device(self) -> torch.device:
        for g in self.groups:
            return g.full.device
        return torch.device("cpu")

    def scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        for g in self._trainable():
            g.grad.mul_(factor)

    def sync_params(self, copy: bool = True) -> None:
        """Cast the updated master into the compute params (unless ``copy`` is False: done
        already), then all-gather resident buffers."""
        inflight: deque[tuple[Handle, int]] = deque()
        for g in self.groups:
            if copy:
                g.copy_master_to_params()
            if not g.needs_param_all_gather:
                continue
            numel = g.layout.padded_numel
            while inflight and sum(n for _, n in inflight) + numel > self.allgather_bucket_numel:
                inflight.popleft()[0].wait()
            lo, hi = g.layout.shard_range(self.comm.rank)
            # In-place all-gather: this rank's slice of ``full`` is both input and output.
            inflight.append((self.comm.all_gather(g.full, g.full[lo:hi]), numel))
        while inflight:
            inflight.popleft()[0].wait()

    def zero_grads(self) -> None:
        for g in self._trainable():
            g.zero_grad()


"""Model-state bytes per rank from the engine's own layout arithmetic (zero/units.py).

The engine (zero/flat_buffer.py) holds, per flat group of padded size P = N*S on rank r:

    params            S (stage 3, sharded group) or P elements, compute dtype
    master_params     the owned range (P at stage 0, S at 1-3) in fp32 (bf16 with
                      bf16_master_weights_and_grads), when it is a copy (compute dtype not
                      the master's, or an offloaded optimizer)
    grads             gradient dtype: the full P buffer at stages 0-1, the shard S at 2-3
    optimizer_states  per real element owned: Adam's (LAMB's) m, v (+ amsgrad's max v), 4
                      bytes each or 2 with bf16_optimizer_states, SGD momentum; plus Adam's
                      4-byte ``step`` tensor per optimizer leaf (a parameter fragment, cut
                      into pieces of split_numel with gradients not in the master's dtype)

:func:`model_state_bytes` returns what ``engine.memory_report()`` reports, to the byte, for
every rank. The rest of this file bounds the transient buffers around them: the gathered
working set of stage 3 and the gradient buffers in flight.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

import torch

from meshzero.estimate.settings import Settings
from meshzero.zero.gather_plan import nested_orders, plan_reuse
from meshzero.zero.offload.nvme_io import CUT, TilePlanner
from meshzero.zero.state import CATEGORIES, TIERS
from meshzero.zero.units import GroupLayout, Layout

Report = dict[str, dict[str, int]]
# memory_report()'s keys (less gathered_params_peak): the model states and the NVMe tiles
REPORT_KEYS = (*CATEGORIES, "offload_buffers")


def reuse_kept(layout: Layout, s: Settings, forward_order: list[int] | None = None
               ) -> frozenset[int]:
    """Stage 3: the units the engine keeps gathered from forward into backward
    (zero/gather_plan.py), for the forward order ``forward_order`` (default: unit order)."""
    if s.stage != 3:
        return frozenset()
    numel = [sum(g.padded_numel for g in u.groups if not g.persistent) for u in layout.units]
    order = forward_order if forward_order is not None else range(len(numel))
    order = [u for u in order if numel[u] > 0]
    release, backward = nested_orders(order, [u.path for u in layout.units])
    return plan_reuse(order, backward, numel, release, max_reuse_distance=s.max_reuse_distance,
                      max_live_parameters=s.max_live_parameters)


def empty_report() -> Report:
    return {c: dict.fromkeys(TIERS, 0) for c in REPORT_KEYS}


@dataclass
class _GroupIndex:
    """Start and end offsets of the non-empty parameters of a group (sorted, disjoint)."""

    group: GroupLayout
    starts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, group: GroupLayout) -> _GroupIndex:
        slots = [s for s in group.slots if s.numel > 0]
        return cls(group, [s.offset for s in slots], [s.offset + s.numel for s in slots])

    def owned(self, lo: int, hi: int) -> tuple[int, int]:
        """(real elements, fragments) inside ``[lo, hi)`` (what group.fragments(lo, hi) gives)."""
        elements = max(0, min(hi, self.group.numel) - lo)
        fragments = bisect_left(self.starts, hi) - bisect_right(self.ends, lo)
        return elements, fragments

    def extra_leaves(self, lo: int, hi: int, split: int | None) -> int:
        """Leaves beyond one per fragment inside ``[lo, hi)`` when fragments longer than
        ``split`` are cut (stepping.split_fragment)."""
        if split is None:
            return 0
        i, j = bisect_right(self.ends, lo), bisect_left(self.starts, hi)
        return sum(-(-(min(hi, e) - max(lo, a)) // split) - 1
                   for a, e in zip(self.starts[i:j], self.ends[i:j], strict=True))


class ModelStates:
    """Per-rank model-state bytes of one layout (one world size) under one Settings."""

    def __init__(self, layout: Layout, settings: Settings):
        self.layout = layout
        self.settings = settings
        self._index = [_GroupIndex.of(g) for g in layout.groups()]

    @property
    def world_size(self) -> int:
        return self.layout.num_shards

    def _sharded(self, group: GroupLayout) -> bool:
        return self.settings.stage == 3 and not group.persistent

    def report(self, rank: int) -> Report:
        """Bytes rank ``rank`` holds at rest, by category and tier, as memory_report() does."""
        s = self.settings
        out = empty_report()
        opt_tier = s.optimizer_tier
        for index in self._index:
            g = index.group
            if self._sharded(g):
                out["params"][s.param_tier] += g.shard_numel * s.compute_bytes
            else:
                out["params"]["device"] += g.padded_numel * s.compute_bytes
            if not s.trains(g):
                continue
            lo, hi = (0, g.padded_numel) if s.stage == 0 else g.shard_range(rank)
            if s.compute_bytes != s.master_bytes or opt_tier != "device":  # a master copy
                out["master_params"][opt_tier] += (hi - lo) * s.master_bytes
            if s.stage <= 1:
                out["grads"]["device"] += g.padded_numel * s.grad_bytes  # accumulation
            if s.stage >= 2 or opt_tier != "device":
                out["grads"][opt_tier] += (hi - lo) * s.grad_bytes  # the gradient shard
            elements, fragments = index.owned(lo, hi)
            fragments += index.extra_leaves(lo, hi, s.split_numel)
            out["optimizer_states"][opt_tier] += (elements * s.state_bytes_per_element
                                                  + fragments * s.state_bytes_per_fragment)
        out["offload_buffers"]["host"] = self.nvme_tile_bytes(rank)
        return out

    def largest_rank(self) -> tuple[int, Report]:
        """The rank holding the most bytes. Ranks differ in optimizer states (real elements
        left after padding, and fragment counts), computed for all ranks at once, and with
        NVMe offload slightly in tile buffers, which do not take part in the choice."""
        s = self.settings
        per_rank = torch.zeros(self.world_size, dtype=torch.int64)
        ranks = torch.arange(self.world_size, dtype=torch.int64)
        for index in self._index:
            g = index.group
            if not s.trains(g) or not index.starts:
                continue
            if s.stage == 0:
                elements, fragments = index.owned(0, g.padded_numel)
                fragments += index.extra_leaves(0, g.padded_numel, s.split_numel)
                per_rank += elements * s.state_bytes_per_element
                per_rank += fragments * s.state_bytes_per_fragment
                continue
            shard = g.shard_numel
            owned = (g.numel - ranks * shard).clamp(0, shard)
            # a parameter [start, end) has a fragment on ranks start // S .. (end - 1) // S
            first = torch.tensor(index.starts, dtype=torch.int64) // shard
            last = (torch.tensor(index.ends, dtype=torch.int64) - 1) // shard
            diff = torch.zeros(self.world_size + 1, dtype=torch.int64)
            diff.index_add_(0, first, torch.ones_like(first))
            diff.index_add_(0, last + 1, -torch.ones_like(last))
            per_rank += owned * s.state_bytes_per_element
            per_rank += diff.cumsum(0)[:-1] * s.state_bytes_per_fragment
            per_rank += self._extra_leaves(index, shard) * s.state_bytes_per_fragment
        rank = int(per_rank.argmax())
        return rank, self.report(rank)

    def _extra_leaves(self, index: _GroupIndex, shard: int) -> torch.Tensor:
        """Per rank: leaves beyond one per fragment (only parameters longer than split_numel
        can be cut, so only those are visited, rank by rank)."""
        split = self.settings.split_numel
        extra = torch.zeros(self.world_size, dtype=torch.int64)
        for a, e in zip(index.starts, index.ends, strict=True):
            if split is None or e - a <= split:
                continue
            for r in range(a // shard, (e - 1) // shard + 1):
                n = min(e, (r + 1) * shard) - max(a, r * shard)
                extra[r] += -(-n // split) - 1
        return extra

    # -- transient buffers ---------------------------------------------------------------------
    def unit_numel(self, *, sharded_only: bool, trainable_only: bool = False) -> list[int]:
        """Padded elements per unit of the groups that are gathered (or reduced) whole."""
        return [sum(g.padded_numel for g in u.groups
                    if (not sharded_only or self._sharded(g))
                    and (not trainable_only or self.settings.trains(g)))
                for u in self.layout.units]

    def gathered_bytes(self, forward_order: list[int] | None = None) -> int:
        """Stage 3: peak bytes of full unit buffers alive at once (the unit in use, the units
        around it, the prefetch), simulating the engine's gather/prefetch/release policy."""
        if self.settings.stage != 3:
            return 0
        numel = self.unit_numel(sharded_only=True)
        order = forward_order if forward_order is not None else range(len(numel))
        order = [u for u in order if numel[u] > 0]
        paths = [u.path for u in self.layout.units]
        reused = reuse_kept(self.layout, self.settings, order)
        peak = 0
        # Backward runs the units in reverse; a unit is released when its gradients are all
        # accumulated, which autograd does (AccumulateGrad first) before the next unit starts,
        # so only after its last use. In forward a unit used again within
        # stage3_max_reuse_distance elements stays gathered until then; the units of the
        # reuse plan stay gathered from their last forward use to their last backward use.
        for seq, backward in ((order, False), (order[::-1], True)):
            kept = self._kept(seq, numel, backward)
            last = {u: i for i, u in enumerate(seq)}
            for pos, unit in enumerate(seq):
                live = {a for a in _ancestors(paths, unit) if numel[a] > 0} | {unit}
                live |= {seq[i] for i, (lo, hi) in kept.items() if lo < pos <= hi}
                live |= {u for u in reused if (pos <= last[u]) == backward}
                live |= self._prefetched(seq, pos, live, numel)
                peak = max(peak, sum(numel[u] for u in live))
        return peak * self.settings.compute_bytes

    def _kept(self, seq: list[int], numel: list[int], backward: bool
              ) -> dict[int, tuple[int, int]]:
        """{i: (i, j)}: the unit used at ``i`` stays gathered until its next use at ``j``."""
        prefix = [0]
        for u in seq:
            prefix.append(prefix[-1] + numel[u])
        last: dict[int, int] = {}
        kept = {}
        for j, u in enumerate(seq):
            i = last.get(u)
            if i is not None and (backward or prefix[j] - prefix[i + 1]
                                  <= self.settings.max_reuse_distance):
                kept[i] = (i, j)
            last[u] = j
        return kept

    def _prefetched(self, seq: list[int], pos: int, live: set[int], numel: list[int]
                    ) -> set[int]:
        """The units after ``pos`` the engine gathers ahead (sharded_params._prefetch)."""
        s = self.settings
        budget = s.prefetch_bucket_size
        out: set[int] = set()
        for u in seq[pos + 1:]:
            if u == seq[pos]:
                continue
            if numel[u] > budget:
                break
            budget -= numel[u]
            if u in live or u in out:
                continue
            if sum(numel[v] for v in live | out) + numel[u] > s.max_live_parameters:
                break
            out.add(u)
        return out

    def bucket_bytes(self) -> tuple[int, int]:
        """(reduce, all-gather) peak bytes of communication buffers beyond the model states.

        Simulates the engine's GradientReducer over the units in its launch order (reverse
        unit index, the root last). At stages 2-3 each unit's gradient is accumulated in a
        transient buffer of its padded size (gradient dtype), kept until its reduce-scatter is
        done; the root's is taken at the start of backward (its head gets the first gradients)
        and reduced last. Before a group is launched the oldest reductions are finished until
        at most reduce_bucket_size elements are in flight (a larger group goes alone). A
        reduce dtype other than the gradient dtype adds a cast copy of each group in flight,
        and a reduce-scatter that cannot write straight into the gradient shard (stage 1,
        later micro-steps, another dtype or an offloaded shard) a shard-sized output. The
        post-step all-gathers write in place into the resident buffers: no extra bytes."""
        s = self.settings
        units = [[g.padded_numel for g in u.groups if s.trains(g)] for u in self.layout.units]
        if not any(units):
            return 0, 0
        transient = s.stage >= 2
        cast = s.reduce_dtype != s.grad_dtype
        indirect = s.stage == 1 or (transient and (s.grad_accum > 1 or cast
                                                   or s.offload_optimizer != "none"))
        gb = s.grad_bytes

        def held(numel: int) -> int:
            out = numel * gb if transient else 0
            if cast:
                out += numel * s.comm_bytes
            if indirect:
                out += numel // self.world_size * s.comm_bytes
            return out

        root = sum(units[0]) * gb if transient else 0  # accumulating from the start
        inflight: deque[tuple[int, int]] = deque()  # (elements, bytes) per group in flight
        peak = root
        for u in [*range(len(units) - 1, 0, -1), 0]:
            pending = sum(units[u]) * gb if transient and u else 0
            for numel in units[u]:
                peak = max(peak, root + pending + sum(b for _, b in inflight))
                while inflight and sum(n for n, _ in inflight) + numel > s.reduce_bucket_size:
                    inflight.popleft()
                if transient:  # this group's buffer moves from accumulating to in flight
                    pending, root = (pending - numel * gb, root) if u else (
                        pending, root - numel * gb)
                inflight.append((numel, held(numel)))
                peak = max(peak, root + pending + sum(b for _, b in inflight))
        return peak, 0

    def nvme_tile_bytes(self, rank: int) -> int:
        """Host bytes of the NVMe optimizer tier's tile buffers (what memory_report() puts
        under ``offload_buffers``): min(buffer_count, tiles) buffers, each holding the largest
        tile's master, fp32 gradient (and the 16-bit one it is converted from), compute
        params and optimizer states, plus a scalar state
        slot (Adam's step) per leaf in blocks of CUT. Tiles come from the engine's own
        TilePlanner over this rank's fragments."""
        s = self.settings
        if s.offload_optimizer != "nvme":
            return 0
        planner = TilePlanner(s.sub_group_size)
        leaves: dict[int, int] = {}
        space = 0
        for g in self.layout.groups():
            if not s.trains(g):
                continue
            lo, hi = (0, g.padded_numel) if s.stage == 0 else g.shard_range(rank)
            for whole in g.fragments(lo, hi):
                for _, tile in planner.add(whole, space + whole.local_offset):
                    leaves[tile] = leaves.get(tile, 0) + 1
            space += hi - lo
        if not planner.bounds:
            return 0
        numel = max(end - start for start, end in planner.bounds)
        most = -(-max(leaves.values()) // CUT) * CUT
        count = min(s.optimizer_buffer_count, len(planner.bounds))
        raw = 0 if s.grad_bytes == 4 else s.grad_bytes  # the 16-bit gradient read in
        per_tile = (numel * (8 + raw + s.compute_bytes + s.state_bytes_per_element)
                    + most * s.state_bytes_per_fragment)
        return count * per_tile

    def param_read_bytes(self) -> int:
        """Host bytes of parameter shards read ahead from NVMe (param_buffer_count of the
        largest sharded group's shard, compute dtype); transient, not in memory_report()."""
        s = self.settings
        if s.offload_param != "nvme":
            return 0
        shards = [g.shard_numel for g in self.layout.groups() if self._sharded(g)]
        return s.param_buffer_count * max(shards, default=0) * s.compute_bytes


def _ancestors(paths: list[str], unit: int) -> list[int]:
    """Units whose module contains unit ``unit``'s module (the root contains all)."""
    path = paths[unit]
    return [i for i, p in enumerate(paths)
            if i != unit and (p == "" or path.startswith(p + "."))]


def total_bytes(report: Report, tier: str | None = None) -> int:
    return sum(v for c in report.values() for t, v in c.items() if tier in (None, t))

"""The named device mesh (pp, dp, sp, tp) and its process groups.

Ranks are laid out with tp innermost (inside a node), then sp (Ulysses sequence parallelism,
all-to-all heavy: inside a node too when tp * sp <= ranks per node), then dp, then pp
outermost, so that ``rank = ((pp_index * dp + dp_index) * sp + sp_index) * tp + tp_index``:
with 4 nodes, pp=4 and tp = ranks per node, each pipeline stage is one node and tensor
slices stay inside it. Node of a rank: ``rank // ranks_per_node`` (torchrun's
LOCAL_WORLD_SIZE unless the config says otherwise).

ZeRO shards over dp x sp (the ``zero`` group), as DeepSpeed does: the sp ranks of a replica
hold the same parameters and see different parts of the same sequences, so to ZeRO they are
data-parallel ranks; the batch rule counts dp only (sp ranks share their samples).
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshzero.config.batch import data_parallel_size

logger = logging.getLogger(__name__)

AXES = ("pp", "dp", "sp", "tp")  # outermost first


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> bool:
    """Initialise the default process group if it is not already.

    Under torchrun (RANK/WORLD_SIZE in the environment) the env:// rendezvous is used; a plain
    ``python train.py`` gets a world of one process. Backend: NCCL with one device per local
    rank when CUDA is available, gloo otherwise. ``timeout`` (``faults.comm_timeout``): how
    long a collective waits for its peers (torch's default, 30 minutes, when None). Returns
    whether it made the group (False: the caller had made it, with its own timeout).
    """
    if dist.is_initialized():
        return False
    # torch.optim's first optimizer imports torch._dynamo, whose import keeps references to
    # the objects torch.distributed holds at that moment; imported after the process group
    # exists, it pins the WORLD group, so destroy_process_group() can no longer free it and
    # gloo's worker and transport threads live on into interpreter exit (docs/lifecycle.md).
    # Imported first, it holds nothing of ours.
    import torch._dynamo  # noqa: F401

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.debug("initialised %s process group of %d ranks", backend, dist.get_world_size())
    return True


def default_device() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Topology:
    """This rank's place in the (pp, dp, sp, tp) mesh and the process group of each axis
    (``groups["zero"]``: dp x sp, the ranks ZeRO shards over)."""

    world_size: int
    rank: int
    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup | None]  # None: the axis has size 1
    device: torch.device
    ranks_per_node: int = 1
    timeout: timedelta | None = None  # of every group made here (faults.comm_timeout)

    def drop_groups(self) -> None:
        """At the end of the engine: hold no process group any more (comm.CommStats.drop_groups
        says why)."""
        self.groups = dict.fromkeys(self.groups)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def coords_of(self, rank: int) -> dict[str, int]:
        return _coords(self.sizes, rank)

    def spans_nodes(self, group: dist.ProcessGroup | None) -> bool:
        """Whether a collective over ``group`` has members on more than one node."""
        if group is None:
            return False
        ranks = dist.get_process_group_ranks(group)
        return len({self.node_of(r) for r in ranks}) > 1

    def dp_subgroups(self, k: int) -> tuple[dist.ProcessGroup | None,
                                            dist.ProcessGroup | None]:
        """Split every dp group into blocks of ``k`` consecutive dp ranks: this rank's block
        (inside a node when k <= ranks per node) and the group of ranks at the same position
        in every block (None where a group would have one rank). Collective: every rank
        creates every group."""
        dp = self.sizes["dp"]
        if k < 1 or dp % k:
            raise ValueError(f"a partition of {k} ranks does not divide the data-parallel size "
                             f"{dp}; valid: divisors of {dp}")
        block = across = None
        for ranks in _axis_ranks(self.sizes, "dp"):
            chunks = [ranks[i:i + k] for i in range(0, dp, k)]
            for members in chunks:
                group = dist.new_group(members, timeout=self.timeout) if k > 1 else None
                if self.rank in members:
                    block = group
            for pos in range(k):
                members = [c[pos] for c in chunks]
                group = (dist.new_group(members, timeout=self.timeout) if len(chunks) > 1
                         else None)
                if self.rank in members:
                    across = group
        return block, across

    def rank_map(self) -> str:
        """For every node, each rank's (pp, dp, sp, tp) coordinates (sp only when > 1)."""
        nodes = -(-self.world_size // self.ranks_per_node)
        shown = [a for a in AXES if a != "sp" or self.sizes["sp"] > 1]
        mesh = " x ".join(f"{a}={self.sizes[a]}" for a in shown)
        lines = [f"mesh {mesh} over {self.world_size} ranks, {self.ranks_per_node} per node "
                 "(tp innermost, pp outermost)"]
        for node in range(nodes):
            ranks = range(node * self.ranks_per_node,
                          min((node + 1) * self.ranks_per_node, self.world_size))
            cells = []
            for r in ranks:
                c = self.coords_of(r)
                cells.append(f"rank {r} (" + ", ".join(f"{a} {c[a]}" for a in shown) + ")")
            lines.append(f"  node {node}: " + ", ".join(cells))
        return "\n".join(lines)

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.groups["dp"]

    @property
    def sp_size(self) -> int:
        return self.sizes["sp"]

    @property
    def sp_rank(self) -> int:
        return self.coords["sp"]

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.groups["sp"]

    @property
    def zero_size(self) -> int:
        """dp x sp: how many ranks hold the same model slice."""
        return self.sizes["dp"] * self.sizes["sp"]

    @property
    def zero_rank(self) -> int:
        """This rank's place among them (the order of ``groups["zero"]``: sp fastest)."""
        return self.coords["dp"] * self.sizes["sp"] + self.coords["sp"]

    @property
    def zero_group(self) -> dist.ProcessGroup | None:
        """dp x sp: the ranks that hold the same model slice (ZeRO shards over them)."""
        return self.groups["zero"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]


def _coords(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """The mesh coordinates of ``rank`` (tp fastest, pp slowest)."""
    coords = {}
    for axis in reversed(AXES):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def _rank_of(sizes: dict[str, int], coords: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + coords[axis]
    return rank


def _axis_ranks(sizes: dict[str, int], *axes: str) -> list[list[int]]:
    """Every group of ranks that vary only along ``axes`` (all ranks must create all groups);
    members in rank order, so the first of ``("dp", "sp")`` varies slowest."""
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for at in itertools.product(*(range(sizes[a]) for a in fixed)):
        base = dict(zip(fixed, at, strict=True))
        groups.append([_rank_of(sizes, {**base, **dict(zip(axes, moving, strict=True))})
                       for moving in itertools.product(*(range(sizes[a]) for a in axes))])
    return groups


def build_topology(tp_size: int = 1, pp_size: int = 1, ranks_per_node: int | None = None,
                   timeout: timedelta | None = None, world_timeout: bool = True,
                   sp_size: int = 1) -> Topology:
    """Build the mesh over the initialised world. ``dp = world / (tp * pp * sp)``. Groups get
    ``timeout``; an axis spanning the world reuses the default group when that has it
    (``world_timeout``; False: the caller made it, maybe with torch's 30-minute default)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    # the config's check, shared with the estimator
    dp = data_parallel_size(world, tp_size, pp_size, sp_size)
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % ranks_per_node != 0 and ranks_per_node < world:
        raise ValueError(f"topology.ranks_per_node = {ranks_per_node} does not divide the world "
                         f"size {world}")
    sizes = {"pp": pp_size, "dp": dp, "sp": sp_size, "tp": tp_size}
    groups: dict[str, dist.ProcessGroup | None] = {}
    for name, axes in [(a, (a,)) for a in AXES] + [("zero", ("dp", "sp"))]:
        size = 1
        for a in axes:
            size *= sizes[a]
        if size == 1:  # nothing to communicate along this axis
            groups[name] = None
            continue
        if size == world and (timeout is None or world_timeout):
            groups[name] = dist.group.WORLD
            continue
        for ranks in _axis_ranks(sizes, *axes):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[name] = group
    return Topology(world, rank, sizes, _coords(sizes, rank), groups, default_device(),
                    min(ranks_per_node, world), timeout)

"""``deepspeed.runtime.pipe.topology``: a Cartesian grid of ranks over named axes, the last
axis varying fastest (rank = row-major index of its coordinate), as DeepSpeed's. meshzero's own
mesh is ``meshzero.topology`` (pp, dp, sp, tp); this answers the questions code asks of
DeepSpeed's grid object."""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any


class ProcessTopology:
    """DeepSpeed's `deepspeed.runtime.pipe.topology.ProcessTopology`: ranks laid row-major
    over ``axes`` of sizes ``dims``."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology(axes={axes}, dims={dims}): one positive size "
                             "per axis")
        self.axes, self.dims = list(axes), [int(d) for d in dims]
        coord_class: Any = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.ProcessCoord = coord_class
        self.mapping = {coord_class._make(c): r for r, c in enumerate(
            itertools.product(*(range(d) for d in self.dims)))}

    def get_rank(self, **coord: int) -> int:
        """DeepSpeed's `ProcessTopology.get_rank`: the rank at a full coordinate."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis {self.axes}, got {sorted(coord)}")
        return self.mapping[self.ProcessCoord(**coord)]

    def get_axis_names(self) -> list[str]:
        """DeepSpeed's `ProcessTopology.get_axis_names`."""
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """DeepSpeed's `ProcessTopology.get_rank_repr`: e.g. ``model_01`` for checkpoint names."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes
                              if a not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """DeepSpeed's `ProcessTopology.get_dim`: an axis's size (0 for an unknown axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """DeepSpeed's `ProcessTopology.get_coord`: the coordinate of ``rank``."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """DeepSpeed's `ProcessTopology.get_axis_comm_lists`: the rank lists along ``axis``
        (one per fixed value of the other axes)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed, strict=True))
            lists.append([self.get_rank(**where, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filters: int) -> list[int]:
        """DeepSpeed's `ProcessTopology.filter_match`: the ranks whose coordinate matches."""
        return [r for c, r in self.mapping.items()
                if all(getattr(c, k) == v for k, v in filters.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """DeepSpeed's `ProcessTopology.get_axis_list`: the ranks with ``axis == idx``."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def world_size(self) -> int:
        """DeepSpeed's `ProcessTopology.world_size`."""
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """DeepSpeed's `deepspeed.runtime.pipe.topology.PipeDataParallelTopology`: axes pipe, data."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """DeepSpeed's `deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology`: axes pipe,
    data, model."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]

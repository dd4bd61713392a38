"""The NVMe tier (``offload_optimizer.device = nvme``): master, gradient shard, optimizer
states and, with ``offload_param.device = nvme``, the stage-3 parameter shards of this rank
in files (:class:`~meshzero.zero.offload.nvme_store.NvmeStore`), stepped tile by tile.

The paths are checked at initialize, before anything is written: they exist, are writable
directories and have room for the files of this node's ranks.
"""

from __future__ import annotations

import os
import shutil
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.nvme_io import TilePlanner
from meshzero.zero.offload.nvme_store import NvmeStore
from meshzero.zero.offload.tier import ShardsToDevice, Tier, placeholder

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup
    from meshzero.zero.sharded_optimizer import ShardedOptimizerState


# -- NVMe path checks (at initialize, before any work) ----------------------------------------
def disk_free(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (tests replace this to simulate a full disk)."""
    return shutil.disk_usage(path).free


def probe_write(path: str) -> None:
    """Create and remove a small file in ``path`` (OSError if that is not possible)."""
    probe = os.path.join(path, f".meshzero-write-test-{os.getpid()}")
    with open(probe, "wb") as f:
        f.write(b"0")
    os.unlink(probe)


def check_nvme_path(key: str, path: str | None, needed: int) -> None:
    """ValueError naming ``key`` unless ``path`` is a writable directory with ``needed``
    bytes free."""
    if path is None:
        raise ValueError(f"{key} is not set; give an existing, writable directory on the "
                         "NVMe drive")
    if not os.path.exists(path):
        raise ValueError(f"{key} = {path!r} does not exist; give an existing, writable "
                         "directory on the NVMe drive")
    if not os.path.isdir(path):
        raise ValueError(f"{key} = {path!r} is not a directory; give a writable directory")
    try:
        probe_write(path)
    except OSError as exc:
        raise ValueError(f"{key} = {path!r} is not writable: {exc.strerror}") from None
    free = disk_free(path)
    if free < needed:
        raise ValueError(f"{key} = {path!r} has {free:,} bytes free but the NVMe offload of "
                         f"the ranks on this node needs {needed:,} bytes")


class NvmeTier(Tier):
    name = "nvme"
    norm_reads_storage = True  # the gradients are in the file (nvme_store.grad_stats)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # where each trainable group's owned range sits in the optimizer space, so its master
        # can go to its file as soon as the group is built
        self.space_numel, self._offsets = 0, {}
        for unit in self.layout.units:
            for g in unit.groups:
                if g.requires_grad:
                    self._offsets[(g.unit, g.index)] = self.space_numel
                    self.space_numel += g.shard_numel
        self._check_space()
        self.store = NvmeStore(self.comm, self.options, self.compute_dtype, self.space_numel,
                               device=self.device, grad_dtype=self.grad_dtype,
                               transfers=self.transfers)

    def _check_space(self) -> None:
        """The paths have room for this node's ranks (upper bound: two generations of master,
        Adam's two states and the params, one gradient shard in the gradient dtype)."""
        opts, space = self.options, self.space_numel
        itemsize = self.compute_dtype.itemsize
        frozen = sum(g.shard_numel for unit in self.layout.units for g in unit.groups
                     if not g.requires_grad and self.stage == 3 and not g.persistent)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        param_bytes = 2 * space * itemsize + (frozen * itemsize if opts.param == "nvme" else 0)
        optim_bytes = space * (2 * 4 + self.grad_dtype.itemsize + 2 * 8)
        paths = {opts.optimizer_nvme_path: ("offload_optimizer", optim_bytes)}
        if opts.param == "nvme" and opts.param_nvme_path != opts.optimizer_nvme_path:
            paths[opts.param_nvme_path] = ("offload_param", param_bytes)
        else:
            paths[opts.optimizer_nvme_path] = ("offload_optimizer", optim_bytes + param_bytes)
        for path, (key, nbytes) in paths.items():
            check_nvme_path(f"zero_optimization.{key}.nvme_path", path, nbytes * local)

    # -- where things live ---------------------------------------------------------------------
    def owned_values(self, group: FlatGroup) -> torch.Tensor:
        """A stage-3 shard with offload_param nvme is in a file: a frozen group's in the file
        of frozen parameters (read on every rank alike: an I/O error raises on all)."""
        if not (group.sharded and self.options.param == "nvme") or self.store.in_memory:
            return super().owned_values(group)
        return self.store.frozen_values(group)

    def master(self, group: FlatGroup, init: torch.Tensor) -> torch.Tensor:
        """The initial master goes straight to its file; the group keeps a placeholder. A
        group frozen at initialize and unfrozen now is appended to the optimizer space (the
        files grow: zeros, Adam's fresh state), as ShardedOptimizerState.add_group does, and
        its parameters are written there too: a trainable group's stage-3 shard is read from
        the parameter file (offload_param nvme), where the step writes its next values."""
        key = (group.layout.unit, group.layout.index)
        if key not in self._offsets:
            self._offsets[key] = self.space_numel
            self.space_numel += group.layout.shard_numel
            self.store.grow(self.space_numel)
            self.store.write_params(self._offsets[key], init)
        self.store.write_master(self._offsets[key], init)
        if self.store.in_memory:  # unfrozen by a checkpoint load: real until its write-back
            return init.detach().float().clone()
        return placeholder(init.numel(), torch.float32)

    def group_added(self, group: FlatGroup) -> None:
        if self.optim_state.space_numel != self.space_numel:
            raise AssertionError(f"optimizer space {self.optim_state.space_numel} != "
                                 f"{self.space_numel} after adding a group")
        tiles = self.optim_state.tiles
        assert tiles is not None, "the optimizer space was planned by tile_planner"
        self.store.add_leaves(self.optim_state.fragment_index, tiles, self.optim_state.tile_of)

    def grad_shard(self, group: FlatGroup) -> torch.Tensor | None:
        return None  # written to the grad file as each unit is reduced

    def tile_planner(self) -> TilePlanner | None:
        return TilePlanner(self.options.sub_group_size)

    def split_numel(self) -> int | None:
        return None  # the tiles convert 16-bit gradients as they are read

    def shard_source(self):
        if self.options.param == "nvme":  # read from the file, then across to the device
            return ShardsToDevice(self.transfers, self.device, self.store.shards)
        return super().shard_source()

    # -- wiring ------------------------------------------------------------------------------
    def attach(self, units: list[list[FlatGroup]], optim_state: ShardedOptimizerState) -> None:
        super().attach(units, optim_state)
        assert optim_state.tiles is not None, "the optimizer space was planned by tile_planner"
        if optim_state.space_numel != self.space_numel:
            raise AssertionError(f"optimizer space {optim_state.space_numel} != layout "
                                 f"{self.space_numel}")
        self.store.attach([g for gs in units for g in gs], optim_state.fragment_index,
                          optim_state.tiles, optim_state.tile_of)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_optimizer(optimizer)
        self.store.attach_optimizer(optimizer)

    # -- gradients and the step ----------------------------------------------------------------
    def store_grad(self, group: FlatGroup, out: torch.Tensor, accumulate: bool) -> None:
        """Across into a pinned staging buffer; once it has landed the worker hands it to
        the store, which writes it to the grad file (nvme_store.py): backward goes on."""
        src = out if out.dtype == self.grad_dtype else out.to(self.grad_dtype)
        if accumulate:
            self._norms = None  # the norm of a sum: read from the file after all
        else:
            self.note_norm(group, src)
        host = self.transfers.staging.take(src.numel(), src.dtype)
        self.transfers.to_host(host, src.detach(),
                               lambda: self.store.take_grad(group, host, accumulate))

    def no_gradient(self, group: FlatGroup) -> None:
        self.store.no_gradient(group)  # its grad file region: what the last step read

    def grad_stats(self, need_norm: bool, need_overflow: bool,
                   weighted: bool = False) -> tuple[float, float] | None:
        """From the norms taken on the device; else read tile by tile from the file."""
        stats = self.device_grad_stats(need_norm)
        if stats is not None:
            return stats
        self.transfers.wait()  # every gradient handed to the store
        return self.store.grad_stats(need_norm, need_overflow)

    def start_backward(self, boundary: bool, step_scale: float | None) -> None:
        super().start_backward(boundary, step_scale)
        self.store.faults.new_backward()

    def agree_io_failures(self) -> bool:
        self.transfers.wait()  # every gradient handed to the store, then written
        self.store.flush_grads()
        return self.store.faults.agree(self.store.world, self.device)

    def refuse_lost_step(self) -> None:
        self.store.faults.refuse()

    def step(self, scale: float) -> None:
        self.transfers.wait()
        self.store.step(self.optimizer, scale, self.optim_state.skipped_leaves)

    def materialized(self, write_back: bool = False) -> AbstractContextManager[None]:
        self.transfers.wait()
        return self.store.materialized(self.optimizer, self.optim_state.fragment_index,
                                       write_back)

    def close(self) -> None:
        super().close()  # the worker first: it may still hand gradients to the store
        self.store.close()

    @property
    def buffer_nbytes(self) -> int:
        return self.store.buffer_nbytes

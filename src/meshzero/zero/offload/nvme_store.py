"""The files of the NVMe tier: master, gradient shard, optimizer states and (stage 3)
parameter shards of this rank, with only ``buffer_count`` tiles in host memory at once.

This rank's *optimizer space* is the concatenation of the owned ranges of its trainable
groups (``group.space_offset`` places each); tiles cut it into ``sub_group_size`` pieces,
and optimizer leaves never straddle a tile. Files in one directory per rank (removed when
the engine goes away):

    master.{0,1}       fp32 master, two generations
    {kind}.{0,1}       every optimizer state tensor, e.g. exp_avg: leaf-shaped kinds by
                       space offset, scalar kinds (Adam's step) by leaf index
    params.{0,1}       the updated parameters in the compute dtype, by space offset
    grad               gradient shard in the gradient dtype, written as each unit is
                       reduced (converted to fp32 as each tile is read for the step)
    frozen             compute-dtype shards of frozen sharded groups (offload_param nvme)

A step reads tile k+1 on a reader thread while tile k is stepped and tile k-1 is written on
a writer thread (``os.preadv``/``os.pwrite`` release the GIL). It writes the *other*
generation; only when every rank has written all its tiles does the generation flip, so an
I/O error leaves every shard on every rank at the previous step (the error names the file
and the parameters of the tile). A failed gradient write is recorded as lost data, never
raised on one rank (nvme_guard.py); the directories record their owner, are reclaimed when
it is dead and removed on SIGTERM (nvme_owner.py).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshzero.zero.flat_buffer import FlatGroup, free_storage
from meshzero.zero.grad_scan import scan_grads
from meshzero.zero.offload.nvme_guard import IOFaults, raise_agreed, world_communicator
from meshzero.zero.offload.nvme_io import (
    CUT,
    NvmeFile,
    NvmeIOError,
    Tile,
    TileBuffers,
    TilePlanner,
)
from meshzero.zero.offload.nvme_memory import read_all, release_all, write_back_all
from meshzero.zero.offload.nvme_owner import CLEANUP, make_rank_dirs, remove_dirs
from meshzero.zero.offload.nvme_shards import ShardReads
from meshzero.zero.offload.stepping import step_subset, subsets_by_group
from meshzero.zero.offload.tier import HOST, OffloadOptions, placeholder
from meshzero.zero.offload.transfer import Transfers

if TYPE_CHECKING:
    from meshzero.comm import Communicator


class NvmeStore:
    """Files, tiles and the tiled optimizer step of one rank."""

    def __init__(self, comm: Communicator, options: OffloadOptions,
                 compute_dtype: torch.dtype, space_numel: int,
                 device: torch.device = HOST, grad_dtype: torch.dtype = torch.float32,
                 transfers: Transfers | None = None):
        """The files; masters arrive by :meth:`write_master` while the groups are built,
        then :meth:`attach` takes the groups and the optimizer leaves. ``device``: where
        the agreement collectives' flags live (the process group's device). ``transfers``
        (the tier's) copies to the device and counts every file access."""
        self.transfers = transfers or Transfers(device, options.pin_memory)
        self.comm = comm
        self.world = world_communicator(comm.stats)  # every rank agrees on I/O faults
        self.device = device
        self.faults = IOFaults()
        self.options = options
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        self.space_numel = space_numel
        self.gen = 0
        self.stepped = False
        self.in_memory = False  # inside materialized(): masters and leaves are real tensors
        self.kinds: dict[str, tuple[torch.dtype, bool]] = {}  # kind -> (dtype, scalar)
        separate = options.param == "nvme" and \
            options.param_nvme_path != options.optimizer_nvme_path
        self.dir, self.param_dir = make_rank_dirs(
            options.optimizer_nvme_path, options.param_nvme_path if separate else None,
            comm.rank)
        token = CLEANUP.add([self.dir, self.param_dir])  # removed on SIGTERM / SIGINT
        self._cleanup = weakref.finalize(self, _remove, [self.dir, self.param_dir], token)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="meshzero-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="meshzero-nvme-write")
        self._pool: list[TileBuffers] = []
        self._grad_writes: deque[Future] = deque()
        self._grad_written: set[int] = set()  # id(group): its grad region may be non-zero
        self._state_ph: dict[tuple[int, str], torch.Tensor] = {}
        self.frozen_offset: dict[int, int] = {}  # id(group) -> its place in "frozen"
        count = self.transfers.count_nvme
        self.shards = ShardReads(self)  # stage-3 shards read ahead (offload_param nvme)
        self.grad_file = NvmeFile(os.path.join(self.dir, "grad"), grad_dtype.itemsize, count)
        self.frozen_file = NvmeFile(os.path.join(self.param_dir, "frozen"),
                                    compute_dtype.itemsize, count)
        for kind in ("master", "params"):
            self._create(kind, scalar=False)
        self._preallocate(self.grad_file.path, self.space_numel * grad_dtype.itemsize)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Each tile's leaves by param group, once (a step passes them to step_subset)."""
        for tile in self.tiles:
            tile.subset = subsets_by_group(optimizer, [leaf for leaf, _, _ in tile.leaves])

    def write_master(self, offset: int, master: torch.Tensor) -> None:
        """The initial fp32 master of one group (from its construction buffer, or the
        values of a group frozen at initialize when it is unfrozen)."""
        self.file("master", self.gen).write(offset, master.detach().float().contiguous().cpu(),
                                            "initial master")

    def write_params(self, offset: int, values: torch.Tensor) -> None:
        """The compute-dtype parameters of a group made trainable, at its place in the
        optimizer space (current generation; ``values``: their exact fp32 values)."""
        self.file("params", self.gen).write(
            offset, values.detach().to(self.compute_dtype).contiguous().cpu(), "params")

    def frozen_values(self, group: FlatGroup) -> torch.Tensor:
        """The shard of a group frozen at initialize (offload_param nvme), read from the
        file of frozen parameters on every rank alike (collective: an I/O error raises on
        every rank)."""
        out = torch.empty(group.layout.shard_numel, dtype=self.compute_dtype)
        self._agreed(self._read_frozen, group, out, what="the frozen shard was not read")
        return out

    def _read_frozen(self, group: FlatGroup, out: torch.Tensor) -> None:
        self.frozen_file.read(self.frozen_offset[id(group)], out,
                              f"parameter shard of {group.layout.slots[0].name}")

    def grow(self, space_numel: int) -> None:
        """The optimizer space grew at its end: every file of it is made longer (zeros)."""
        self.flush_grads()
        self.space_numel = space_numel
        files = [self.file(k, gen) for k in ("master", "params", *self.kinds) for gen in (0, 1)
                 if not self.kinds.get(k, (None, False))[1]]
        for f in [*files, self.grad_file]:
            f.extend(space_numel)

    def add_leaves(self, index: list, planner: TilePlanner, tile_of: list[int]) -> None:
        """Leaves appended to ``index`` (a group made trainable): tiles planned again, the
        scalar state files longer, tile buffers sized again at the next step."""
        self.leaves = [leaf for leaf, _, _ in index]
        self.tiles = self._tiles(index, planner, tile_of)
        for leaf, frag, g in index:
            if id(leaf) not in self.leaf_placeholders:
                self.leaf_placeholders[id(leaf)] = leaf.data
                if self.in_memory:  # a checkpoint is being loaded: as read_all leaves it
                    leaf.data = g.master[frag.local_offset:frag.local_offset + frag.numel]
        self._pool = []
        for kind in [k for k, (_, scalar) in self.kinds.items() if scalar]:
            for gen in (0, 1):
                self.file(kind, gen).extend(len(self.leaves))

    def attach(self, groups: list[FlatGroup], index: list, planner: TilePlanner,
               tile_of: list[int]) -> None:
        self.groups = groups
        self.tile_numel = planner.tile_numel
        self.leaves = [leaf for leaf, _, _ in index]
        self.tiles = self._tiles(index, planner, tile_of)
        self.leaf_placeholders = {id(leaf): leaf.data for leaf in self.leaves}
        self._write_initial_state()

    # -- layout ----------------------------------------------------------------------------
    def _tiles(self, index: list, planner: TilePlanner, tile_of: list[int]) -> list[Tile]:
        tiles = [Tile(k, start, end, -1) for k, (start, end) in enumerate(planner.bounds)]
        for i, ((leaf, frag, group), k) in enumerate(zip(index, tile_of, strict=True)):
            tile = tiles[k]
            if tile.first_leaf < 0:
                tile.first_leaf = i
            a = group.space_offset + frag.local_offset - tile.start
            tile.leaves.append((leaf, a, a + frag.numel))
            tile.names.append(frag.slot.name)
        return tiles

    def file(self, kind: str, gen: int) -> NvmeFile:
        dtype, _ = self.kinds.get(kind, (torch.float32, False))
        if kind == "params":
            dtype = self.compute_dtype
        directory = self.param_dir if kind == "params" else self.dir
        return NvmeFile(os.path.join(directory, f"{kind}.{gen}"), dtype.itemsize,
                        self.transfers.count_nvme)

    def _write_initial_state(self) -> None:
        """Compute params of every trainable group to generation 0 (the masters are there
        already); stage-3 shards go to files too with offload_param nvme."""
        frozen_at = 0
        for g in self.groups:
            if g.trainable:
                src = g.owned_params()
                self.file("params", 0).write(g.space_offset, src.contiguous().cpu(),
                                             "initial params")
            elif g.sharded and self.options.param == "nvme":
                self.frozen_offset[id(g)] = frozen_at
                self.frozen_file.write(frozen_at, g.shard.cpu(), "initial frozen params")
                frozen_at += g.layout.shard_numel
            if g.sharded and self.options.param == "nvme":
                free_storage(g.shard)

    @staticmethod
    def _preallocate(path: str, nbytes: int) -> None:
        with open(path, "wb") as f:
            f.truncate(nbytes)

    def _create(self, kind: str, scalar: bool) -> None:
        """Both generations of ``kind``'s file at full size (padding included)."""
        for gen in (0, 1):
            f = self.file(kind, gen)
            self._preallocate(f.path, (len(self.leaves) if scalar else self.space_numel)
                              * f.itemsize)

    def learn_kind(self, kind: str, value: torch.Tensor) -> bool:
        """Record a state kind the optimizer created; True if it is new."""
        if kind in self.kinds:
            return False
        self.kinds[kind] = (value.dtype, value.dim() == 0)
        self._create(kind, value.dim() == 0)
        return True

    # -- gradients (main thread, as units are reduced) --------------------------------------
    def take_grad(self, group: FlatGroup, host: torch.Tensor, accumulate: bool) -> None:
        """``host`` (a staging buffer of the transfers, in the gradient dtype, given back
        once written) added (``accumulate``) or written to the grad file, as an in-memory
        gradient shard would be; an I/O error is recorded as lost data (the step refuses
        on every rank), never raised here on one rank."""
        what = f"gradient of {group.layout.slots[0].name} and its group"
        self._grad_written.add(id(group))
        if not accumulate:
            self.faults.new_backward()  # a pipeline's held gradients never start_backward
        if accumulate:
            self.flush_grads()
            prev = torch.empty_like(host)
            if self.faults.run(self.grad_file.read, group.space_offset, prev, what):
                host.add_(prev)
        self._grad_writes.append(self._writer.submit(
            self._write_grad, group.space_offset, host, what))
        while len(self._grad_writes) > self.options.buffer_count:
            self._grad_writes.popleft().result()

    def no_gradient(self, group: FlatGroup) -> None:
        """No gradient reached ``group`` in the window's first reduction (frozen): its grad
        file region is zeroed, once (the file starts sparse: all zeros)."""
        if id(group) in self._grad_written:
            self.flush_grads()
            zeros = torch.zeros(group.layout.shard_numel, dtype=self.grad_dtype)
            what = f"gradient of {group.layout.slots[0].name} and its group (zeros)"
            if self.faults.run(self.grad_file.write, group.space_offset, zeros, what):
                self._grad_written.discard(id(group))

    def _write_grad(self, offset: int, host: torch.Tensor, what: str) -> None:
        try:
            self.faults.run(self.grad_file.write, offset, host, what)
        finally:
            self.transfers.staging.give(host)

    def flush_grads(self) -> None:
        while self._grad_writes:
            self._grad_writes.popleft().result()

    def grad_stats(self, need_norm: bool, need_overflow: bool) -> tuple[float, float]:
        """Local squared norm and count of non-finite gradient elements, read tile by tile."""
        self.flush_grads()
        sq, bad = 0.0, 0.0
        buf = torch.empty(self.tile_numel, dtype=self.grad_dtype)
        for tile in self.tiles:
            g = buf[:tile.numel]
            if not self.faults.run(self.grad_file.read, tile.start, g, tile.describe()):
                continue  # lost: the step below is refused on every rank
            tile_sq, tile_bad = scan_grads([g], need_norm=need_norm).tolist()
            sq += tile_sq
            bad += tile_bad
        return sq, bad

    # -- the tiled step -----------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, scale: float,
             skipped: frozenset[int] = frozenset()) -> None:
        """One optimizer step over every tile, committed on all ranks or on none. Leaves
        whose id is in ``skipped`` (frozen through the window, zero/trainability.py) keep
        ``.grad`` None: torch.optim leaves them and their state alone."""
        self.flush_grads()
        self.shards.drop()
        new = 1 - self.gen
        snapshot = {id(p): dict(s) for p, s in optimizer.state.items()}
        error: Exception | None = None
        if self.faults.lost is not None:  # a gradient read of grad_stats failed
            error = NvmeIOError(self.faults.lost)
        fresh: list[tuple[FlatGroup, torch.Tensor]] = []
        try:
            if error is None:
                self._step_tiles(optimizer, scale, new, skipped)
                fresh = self._read_params(new)  # before the commit: a failure is agreed on
        except NvmeIOError as exc:
            error = exc
        try:
            raise_agreed(self.world, self.device, error,
                         "the optimizer step was not applied on any rank")
        except NvmeIOError:
            self._restore(optimizer, snapshot)
            raise
        self.gen = new
        self.stepped = True
        for g, host in fresh:
            self.transfers.to_device(g.owned_params(), host, release=partial(
                self.transfers.staging.give, host))

    def _restore(self, optimizer: torch.optim.Optimizer, snapshot: dict) -> None:
        for leaf in self.leaves:
            saved = snapshot.get(id(leaf))
            if saved is None:
                optimizer.state.pop(leaf, None)
            else:
                optimizer.state[leaf] = saved
            leaf.data, leaf.grad = self.leaf_placeholders[id(leaf)], None

    def _buffers(self) -> list[TileBuffers]:
        if not self._pool:
            most = max(len(t.leaves) for t in self.tiles) if self.tiles else 0
            most = -(-most // CUT) * CUT  # scalar-state slots, in blocks of CUT
            numel = max(t.numel for t in self.tiles) if self.tiles else 0
            count = min(self.options.buffer_count, max(len(self.tiles), 1))
            self._pool = [TileBuffers(numel, most, self.compute_dtype,
                                      self.options.pin_memory, self.grad_dtype)
                          for _ in range(count)]
        return self._pool

    def _step_tiles(self, optimizer: torch.optim.Optimizer, scale: float, new: int,
                    skipped: frozenset[int]) -> None:
        free = deque(self._buffers())
        tiles = iter(self.tiles)
        reads: deque[tuple[Tile, TileBuffers, Future]] = deque()
        writes: deque[tuple[TileBuffers, Future]] = deque()

        def issue_reads() -> None:
            while free:
                tile = next(tiles, None)
                if tile is None:
                    return
                buf = free.popleft()
                reads.append((tile, buf, self.reader.submit(self._read_tile, tile, buf)))

        try:
            issue_reads()
            while reads:
                tile, buf, fut = reads.popleft()
                fut.result()
                self._step_tile(optimizer, tile, buf, scale, skipped)
                writes.append((buf, self._writer.submit(self._write_tile, tile, buf, new)))
                while writes and (writes[0][1].done() or not free):
                    done, fut = writes.popleft()
                    fut.result()
                    free.append(done)
                issue_reads()
            while writes:
                writes.popleft()[1].result()
        finally:  # never leave a thread working on a buffer after an error
            for *_, fut in list(reads) + list(writes):
                fut.exception()

    def _read_tile(self, tile: Tile, buf: TileBuffers) -> None:
        n, what = tile.numel, tile.describe()
        self.file("master", self.gen).read(tile.start, buf.master[:n], what)
        if buf.grad_raw is None:
            self.grad_file.read(tile.start, buf.grad[:n], what)
        else:  # a 16-bit gradient file: read, then converted to fp32 for the step
            self.grad_file.read(tile.start, buf.grad_raw[:n], what)
            buf.grad[:n].copy_(buf.grad_raw[:n])
        if not self.stepped:
            return
        for kind, (dtype, scalar) in self.kinds.items():
            target = buf.kind(kind, dtype, scalar)
            if scalar:
                self.file(kind, self.gen).read(tile.first_leaf, target[:len(tile.leaves)], what)
            else:
                self.file(kind, self.gen).read(tile.start, target[:n], what)

    def _write_tile(self, tile: Tile, buf: TileBuffers, gen: int) -> None:
        n, what = tile.numel, tile.describe()
        self.file("master", gen).write(tile.start, buf.master[:n], what)
        self.file("params", gen).write(tile.start, buf.params[:n], what)
        for kind, (_, scalar) in self.kinds.items():
            if scalar:
                self.file(kind, gen).write(tile.first_leaf, buf.kinds[kind][:len(tile.leaves)],
                                           what)
            else:
                self.file(kind, gen).write(tile.start, buf.kinds[kind][:n], what)

    def _step_tile(self, optimizer: torch.optim.Optimizer, tile: Tile, buf: TileBuffers,
                   scale: float, skipped: frozenset[int]) -> None:
        n = tile.numel
        if scale != 1.0:
            buf.grad[:n].mul_(scale)
        for i, (leaf, a, b) in enumerate(tile.leaves):
            leaf.data = buf.master[a:b]
            leaf.grad = None if id(leaf) in skipped else buf.grad[a:b]
            if self.stepped:
                state = optimizer.state[leaf]
                for kind, (dtype, scalar) in self.kinds.items():
                    t = buf.kind(kind, dtype, scalar)
                    state[kind] = t[i] if scalar else t[a:b]
        step_subset(optimizer, tile.subset, skipped)
        for i, (leaf, a, b) in enumerate(tile.leaves):
            state = optimizer.state[leaf]
            for kind, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                scalar = value.dim() == 0
                self.learn_kind(kind, value)
                t = buf.kind(kind, value.dtype, scalar)
                view = t[i] if scalar else t[a:b]
                if view.data_ptr() != value.data_ptr():  # state created by this first step
                    view.copy_(value)
                state[kind] = self.state_placeholder(leaf, kind, value)
            leaf.data, leaf.grad = self.leaf_placeholders[id(leaf)], None
        buf.zero_missing(tile, self.kinds, lambda leaf: optimizer.state.get(leaf, {}))
        buf.params[:n].copy_(buf.master[:n])

    def state_placeholder(self, leaf: nn.Parameter, kind: str, value: torch.Tensor):
        key = (id(leaf), kind)
        if key not in self._state_ph:
            self._state_ph[key] = placeholder(value.numel(), value.dtype, tuple(value.shape))
        return self._state_ph[key]

    # -- compute parameters ------------------------------------------------------------------
    def _read_params(self, gen: int) -> list[tuple[FlatGroup, torch.Tensor]]:
        """The updated compute params of generation ``gen`` for the device (or host)
        buffers; with offload_param nvme the sharded groups are read at their next
        all-gather."""
        out = []
        for g in self.groups:
            if not g.trainable or (g.sharded and self.options.param == "nvme"):
                continue
            lo, hi = g.owned
            host = self.transfers.staging.take(hi - lo, self.compute_dtype)
            self.file("params", gen).read(g.space_offset, host,
                                          f"parameters of {g.layout.slots[0].name}")
            out.append((g, host))
        return out

    # -- everything in memory at once (checkpoints, full_state_dict) -------------------------
    @contextmanager
    def materialized(self, optimizer: torch.optim.Optimizer, index: list,
                     write_back: bool) -> Iterator[None]:
        """Read every master, state tensor and (param nvme) shard into memory; with
        ``write_back`` write them to the current generation afterwards. An I/O error on
        any rank raises on every rank (collective: every rank enters it)."""
        self.flush_grads()
        try:
            self.in_memory = True
            self._agreed(read_all, self, optimizer, index, what="nothing was read")
            yield
            if write_back:
                self._agreed(write_back_all, self, optimizer, index,
                             what="the values were not all written to the NVMe files")
        finally:
            self.in_memory = False
            release_all(self, optimizer, index)

    def _agreed(self, fn, *args, what: str) -> None:
        error = None
        try:
            fn(*args)
        except NvmeIOError as exc:
            error = exc
        raise_agreed(self.world, self.device, error, what)

    # -- accounting ----------------------------------------------------------------------------
    @property
    def buffer_nbytes(self) -> int:
        return sum(b.nbytes for b in self._pool)

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._cleanup()


def _remove(paths: list[str], token: int) -> None:
    remove_dirs(paths)  # first: discarding the last token restores SIGTERM's default
    CLEANUP.discard(token)

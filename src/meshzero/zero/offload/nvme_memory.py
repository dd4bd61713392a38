"""An NVMe store's values all in memory at once (checkpoints, ``full_state_dict``): read
from the current generation, written back after a load, then released to placeholders
(:meth:`NvmeStore.materialized` runs these on every rank; an I/O error raises on all)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.tier import placeholder

if TYPE_CHECKING:
    from meshzero.zero.offload.nvme_store import NvmeStore


def read_all(store: NvmeStore, optimizer: torch.optim.Optimizer, index: list) -> None:
    """Every master, optimizer state and (offload_param nvme) shard into memory, from the
    current generation."""
    # fresh tensors rather than re-grown storage: a checkpoint writer may hand them to
    # numpy, which pins their storage size
    for g in store.groups:
        if g.trainable:
            assert g.master is not None  # a trainable group holds its master shard
            g.master = torch.empty_like(g.master)
            store.file("master", store.gen).read(g.space_offset, g.master, "master")
        if g.sharded and store.options.param == "nvme":
            g.shard = store.shards.read_now(g)
    for i, (leaf, frag, g) in enumerate(index):
        leaf.data = g.master[frag.local_offset:frag.local_offset + frag.numel]
        if store.stepped:
            state = optimizer.state[leaf]
            for kind, (dtype, scalar) in store.kinds.items():
                t = torch.empty((), dtype=dtype) if scalar else torch.empty_like(leaf.data)
                pos = i if scalar else g.space_offset + frag.local_offset
                store.file(kind, store.gen).read(pos, t.reshape(-1), kind)
                state[kind] = t


def write_back_all(store: NvmeStore, optimizer: torch.optim.Optimizer, index: list) -> None:
    """What :func:`read_all` read (perhaps changed: a checkpoint load) to the current
    generation; a state kind seen for the first time gets its files."""
    for g in store.groups:
        if g.trainable:
            assert g.master is not None  # a trainable group holds its master shard
            store.file("master", store.gen).write(g.space_offset, g.master, "master")
            src = g.owned_params()
            store.file("params", store.gen).write(g.space_offset, src.contiguous().cpu(),
                                                  "params")
        elif g.sharded and store.options.param == "nvme":
            store.frozen_file.write(store.frozen_offset[id(g)], g.shard.cpu(), "frozen params")
    for i, (leaf, frag, g) in enumerate(index):
        for kind, value in optimizer.state.get(leaf, {}).items():
            if isinstance(value, torch.Tensor):
                scalar = value.dim() == 0
                store.learn_kind(kind, value)
                pos = i if scalar else g.space_offset + frag.local_offset
                store.file(kind, store.gen).write(pos, value.detach().reshape(-1).cpu(), kind)
                store.stepped = True


def release_all(store: NvmeStore, optimizer: torch.optim.Optimizer, index: list) -> None:
    """Back to placeholders: the values live in the files again."""
    for leaf, _, _ in index:
        state = optimizer.state.get(leaf, {})
        for kind, value in list(state.items()):
            if isinstance(value, torch.Tensor) and kind in store.kinds:
                state[kind] = store.state_placeholder(leaf, kind, value)
        leaf.data = store.leaf_placeholders[id(leaf)]
    for g in store.groups:
        if g.trainable:
            assert g.master is not None  # a trainable group holds its master shard
            g.master = placeholder(g.master.numel(), g.master.dtype)
        if g.sharded and store.options.param == "nvme":
            g.shard = placeholder(g.shard.numel(), g.shard.dtype)

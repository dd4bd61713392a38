"""Offload: where this rank's master shard, gradient shard and optimizer states live.

Tiers (``memory_report()`` names them): ``device`` is the accelerator (or the CPU when there
is none), ``host`` is buffers meshzero keeps in host memory on purpose (pinned on CUDA), and
``nvme`` is files under ``nvme_path``. On a CPU-only machine the host tier is the same
physical memory as the device, but it is still a second copy kept apart, exactly as on a GPU.

    tier.py       the Tier protocol, OffloadOptions, host buffers, memory accounting
    device.py     DeviceTier: no offload
    host.py       HostTier: host buffers, units stepped on a worker thread during backward
    nvme.py       NvmeTier: path checks, files through nvme_store.py, tiles from nvme_io.py
    nvme_guard.py lost I/O data, every rank's agreement on it, the refused step
    nvme_owner.py directory owners, stale directories reclaimed, removal on SIGTERM/SIGINT
    nvme_shards.py stage-3 parameter shards read from their files ahead of the all-gather
    transfer.py   every host<->device copy (pinned staging, copy stream and events on CUDA)
                  and file access, counted: ``engine.transfer_report()``
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.device import DeviceTier
from meshzero.zero.offload.host import HostTier
from meshzero.zero.offload.nvme import NvmeTier
from meshzero.zero.offload.nvme_io import NvmeIOError
from meshzero.zero.offload.tier import CATEGORIES, HOST, TIERS, OffloadOptions, Tier

if TYPE_CHECKING:
    from meshzero.comm import Communicator
    from meshzero.zero.units import Layout

__all__ = ["CATEGORIES", "HOST", "TIERS", "DeviceTier", "HostTier", "NvmeIOError", "NvmeTier",
           "OffloadOptions", "Tier", "make_tier"]

_TIER_OF = {"none": DeviceTier, "cpu": HostTier, "nvme": NvmeTier}


def make_tier(options: OffloadOptions, *, comm: Communicator, device: torch.device,
              layout: Layout, stage: int, compute_dtype: torch.dtype,
              grad_dtype: torch.dtype = torch.float32,
              master_dtype: torch.dtype = torch.float32) -> Tier:
    """The tier of ``options.optimizer`` (the config's ``offload_optimizer.device``), with
    ``options.param`` placing stage-3 parameter shards. The NVMe tier checks its paths and
    creates its files here, before any group is built. Host buffers are pinned only for a
    CUDA device (page-locked memory speeds up copies to a GPU and nothing else)."""
    if options.pin_memory and device.type != "cuda":
        options = replace(options, pin_memory=False)
    return _TIER_OF[options.optimizer](options, comm=comm, device=device, layout=layout,
                                       stage=stage, compute_dtype=compute_dtype,
                                       grad_dtype=grad_dtype, master_dtype=master_dtype)

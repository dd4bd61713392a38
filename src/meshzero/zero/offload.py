"""Offload: the host tier, and what the host and NVMe tiers share.

Tiers (``memory_report()`` names them): ``device`` is the accelerator (or the CPU when there
is none), ``host`` is buffers meshzero keeps in host memory on purpose (pinned on CUDA), and
``nvme`` is files under ``nvme_path``. On a CPU-only machine the host tier is the same
physical memory as the device, but it is still a second copy kept apart, exactly as on a GPU.

With ``offload_optimizer.device = cpu`` the fp32 master, its gradient shard and the optimizer
states of this rank live in host memory and the fused CPU kernel steps them. When nothing
needs the global gradient first (no clipping, no fp16 overflow check) each unit is stepped
on a worker thread as soon as its gradient shard has been reduced, while backward goes on
with the remaining units (:class:`UnitStepper`); otherwise the whole step runs in
``engine.step()``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from meshzero.log import warn_once

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadOptions:
    optimizer: str = "none"  # none | cpu | nvme
    param: str = "none"
    optimizer_nvme_path: str | None = None
    param_nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4  # optimizer tiles in host memory at once (nvme)
    param_buffer_count: int = 5  # unit shards read ahead (param nvme)
    sub_group_size: int = 1_000_000_000

    @classmethod
    def from_config(cls, zc) -> OffloadOptions:
        opt, par = zc.offload_optimizer, zc.offload_param
        pin = opt.pin_memory or par.pin_memory
        return cls(optimizer=opt.device, param=par.device, optimizer_nvme_path=opt.nvme_path,
                   param_nvme_path=par.nvme_path, pin_memory=pin and _can_pin(),
                   buffer_count=opt.buffer_count, param_buffer_count=par.buffer_count,
                   sub_group_size=zc.sub_group_size)

    @property
    def optimizer_tier(self) -> str:
        return {"none": "device", "cpu": "host", "nvme": "nvme"}[self.optimizer]

    @property
    def param_tier(self) -> str:
        return {"none": "device", "cpu": "host", "nvme": "nvme"}[self.param]


def _can_pin() -> bool:
    if torch.cuda.is_available():
        return True
    warn_once(logger, "offload pin_memory is ignored: there is no CUDA device to pin for")
    return False


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


def host_copy(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.empty(t.numel(), dtype=dtype or t.dtype, pin_memory=pin)
    out.copy_(t.detach().reshape(-1))
    return out


def placeholder(numel: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None
                ) -> torch.Tensor:
    """A tensor of ``numel`` elements whose storage is empty: its values live elsewhere (an
    NVMe file) and are swapped in by pointing ``.data`` at a buffer."""
    t = torch.empty(max(numel, 1) if shape == () else numel, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t.view(shape) if shape is not None else t


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


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


def check_nvme_path(key: str, path: str, needed: int) -> None:
    """ValueError naming ``key`` unless ``path`` is a writable directory with ``needed``
    bytes free."""
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

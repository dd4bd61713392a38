"""``deepspeed.runtime.utils``: the helpers real training code calls from it."""

from __future__ import annotations

import gc
import logging
import random

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["see_memory_usage", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.set_random_seed`: seeds Python's `random`, numpy
    (the seed taken modulo 2**32, as numpy accepts only 32-bit seeds) and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`: with ``force``, rank 0 logs
    ``message`` with the accelerator's allocated / peak / reserved memory and the host's used
    memory, as one INFO line (DeepSpeed prints; meshzero's library code logs)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    from meshzero.deepspeed.accelerator import get_accelerator

    gc.collect()  # the figures after what Python can free, as DeepSpeed's
    acc = get_accelerator()
    gib = 1024**3
    logger.info("%s | MA %.2f GB Max_MA %.2f GB CA %.2f GB Max_CA %.2f GB | CPU used %.2f GB",
                message, acc.memory_allocated() / gib, acc.max_memory_allocated() / gib,
                acc.memory_reserved() / gib, acc.max_memory_reserved() / gib,
                _host_used_bytes() / gib)
    acc.reset_peak_memory_stats()


def _host_used_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except OSError:
        return 0
    return fields.get("MemTotal", 0) - fields.get("MemAvailable", 0)

"""``deepspeed.runtime.utils``: the helpers real training code calls from it."""

from __future__ import annotations

import gc
import random

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["see_memory_usage", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.set_random_seed`: seeds Python's `random`, numpy
    (the seed taken modulo 2**32, as numpy accepts only 32-bit seeds) and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`: with ``force``, rank 0 prints
    ``message`` and the accelerator's allocated / peak / reserved memory and the host's used
    memory (a report the caller asked for, printed as DeepSpeed's)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    from meshzero.deepspeed.accelerator import get_accelerator

    gc.collect()  # the figures after what Python can free, as DeepSpeed's
    acc = get_accelerator()
    gib = 1024**3
    print(message, flush=True)
    print(f"MA {acc.memory_allocated() / gib:.2f} GB Max_MA {acc.max_memory_allocated() / gib:.2f}"
          f" GB CA {acc.memory_reserved() / gib:.2f} GB Max_CA "
          f"{acc.max_memory_reserved() / gib:.2f} GB | CPU used {_host_used_bytes() / gib:.2f} GB",
          flush=True)
    acc.reset_peak_memory_stats()


def _host_used_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except OSError:
        return 0
    return fields.get("MemTotal", 0) - fields.get("MemAvailable", 0)

"""``deepspeed.runtime.utils``: the helpers real training code imports from it (Megatron's
``see_memory_usage``, DeepSpeedExamples' ``set_random_seed``)."""

from __future__ import annotations

import gc
import random

import numpy as np
import torch
import torch.distributed as dist

_GB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`: prints ``message`` and the
    device memory (allocated, peak, reserved) on rank 0 when ``force``; resets the peak."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    print(message, flush=True)
    if torch.cuda.is_available():
        print(f"MA {torch.cuda.memory_allocated() / _GB:.2f} GB "
              f"Max_MA {torch.cuda.max_memory_allocated() / _GB:.2f} GB "
              f"CA {torch.cuda.memory_reserved() / _GB:.2f} GB "
              f"Max_CA {torch.cuda.max_memory_reserved() / _GB:.2f} GB", flush=True)
        torch.cuda.reset_peak_memory_stats()
    else:
        print("MA 0.00 GB Max_MA 0.00 GB CA 0.00 GB Max_CA 0.00 GB (no accelerator)",
              flush=True)


def set_random_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.runtime.utils.set_random_seed`: seeds ``random``, numpy (the
    seed modulo 2**32, as DeepSpeed) and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)

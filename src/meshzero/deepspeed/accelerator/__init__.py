"""DeepSpeed's ``deepspeed.accelerator``: ``get_accelerator()`` for CUDA and the CPU, each
method one line over torch (``devices.py``; ``real_accelerator.py`` picks one)."""

from meshzero.deepspeed.accelerator.devices import CPU_Accelerator, CUDA_Accelerator
from meshzero.deepspeed.accelerator.real_accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["CPU_Accelerator", "CUDA_Accelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]

"""DeepSpeed's ``deepspeed.accelerator.real_accelerator``: ``get_accelerator`` picks CUDA when
torch sees a GPU, else the CPU (``DS_ACCELERATOR=cuda|cpu`` chooses, as in DeepSpeed)."""

from __future__ import annotations

import os
from typing import Any

import torch

from meshzero.deepspeed.accelerator.devices import CPU_Accelerator, CUDA_Accelerator

# the accelerator of this process, made on first use (DeepSpeed keeps one too): the CPU's
# tracks its peak memory across calls
_CHOSEN: dict[str, Any] = {}
_KINDS = {"cuda": CUDA_Accelerator, "cpu": CPU_Accelerator}


def get_accelerator() -> Any:
    """DeepSpeed's `deepspeed.accelerator.get_accelerator`: CUDA's with a GPU, else the CPU's."""
    if "accelerator" not in _CHOSEN:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available()
                                                    else "cpu")
        if name not in _KINDS:
            raise ValueError(f"DS_ACCELERATOR={name!r}: meshzero's accelerators are "
                             f"{sorted(_KINDS)}")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR='cuda' but torch sees no CUDA device; unset it or "
                             "use 'cpu'")
        _CHOSEN["accelerator"] = _KINDS[name]()
    return _CHOSEN["accelerator"]


def set_accelerator(accel_obj: Any) -> None:
    """DeepSpeed's `deepspeed.accelerator.set_accelerator`: the object get_accelerator returns."""
    _CHOSEN["accelerator"] = accel_obj


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's `deepspeed.accelerator.is_current_accelerator_supported`: cuda or cpu."""
    return getattr(get_accelerator(), "_name", None) in _KINDS

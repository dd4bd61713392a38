"""``deepspeed.checkpoint.utils``: where OpenRLHF, accelerate and axolotl import
``clone_tensors_for_torch_save`` from (the same function as
``meshzero.deepspeed.utils.clone_tensors_for_torch_save``)."""

from __future__ import annotations

from typing import Any


def clone_tensors_for_torch_save(item: Any, device: Any = None) -> Any:
    """DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: the same function.

    ``meshzero.deepspeed.checkpoint_utils.clone_tensors_for_torch_save``."""
    from meshzero.deepspeed.checkpoint_utils import clone_tensors_for_torch_save as clone

    return clone(item) if device is None else clone(item, device)

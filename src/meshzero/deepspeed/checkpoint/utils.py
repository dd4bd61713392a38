"""``deepspeed.checkpoint.utils``: DeepSpeed's import path of ``clone_tensors_for_torch_save``."""

from meshzero.deepspeed.checkpoint_utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]

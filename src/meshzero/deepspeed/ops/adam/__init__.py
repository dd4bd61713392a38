"""DeepSpeed's ``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` over torch's
Adam (``fused_adam.py``)."""

from meshzero.deepspeed.ops.adam.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

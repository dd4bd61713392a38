"""DeepSpeed's ``deepspeed.ops.adam.cpu_adam`` module path: ``DeepSpeedCPUAdam``."""

from meshzero.deepspeed.ops.adam.fused_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]

"""DeepSpeed's ``deepspeed.ops.lion``: ``FusedLion`` and ``DeepSpeedCPULion``."""

from meshzero.deepspeed.ops.lion.fused_lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

"""DeepSpeed's ``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` over torch's Adagrad."""

from meshzero.deepspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]

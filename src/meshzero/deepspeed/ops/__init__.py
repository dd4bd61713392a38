"""DeepSpeed's ``deepspeed.ops``: the optimizers real code builds (``ops.adam.FusedAdam``,
``ops.adam.DeepSpeedCPUAdam``, ``ops.lamb.FusedLamb``), each a ``torch.optim.Optimizer`` that
meshzero rebuilds over ZeRO's fragments. DeepSpeed's other ops (sparse attention, its
transformer kernels, quantizers) are CUDA extensions meshzero does not have."""

from meshzero.deepspeed.ops import adam, lamb

__all__ = ["adam", "lamb"]

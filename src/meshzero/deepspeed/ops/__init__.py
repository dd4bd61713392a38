"""DeepSpeed's ``deepspeed.ops``: the optimizers real code builds (``ops.adam.FusedAdam``,
``ops.adam.DeepSpeedCPUAdam``, ``ops.lamb.FusedLamb``, ``ops.adagrad.DeepSpeedCPUAdagrad``,
``ops.lion``), each a ``torch.optim.Optimizer`` that meshzero rebuilds over ZeRO's fragments, and
``op_builder`` (DeepSpeed's extension builders: meshzero compiles none, ``load()`` raises
naming what it uses instead). DeepSpeed's other ops (sparse attention, its transformer
kernels, quantizers) are CUDA extensions meshzero does not have."""

from meshzero.deepspeed.ops import adagrad, adam, lamb, lion, op_builder

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder"]

"""``deepspeed.runtime.base_optimizer``: the base class code tests optimizers against."""

from __future__ import annotations


class DeepSpeedOptimizer:
    """DeepSpeed's `deepspeed.runtime.base_optimizer.DeepSpeedOptimizer`: a marker base class;
    meshzero's engine optimizers are ``torch.optim`` optimizers, so Lightning's
    ``isinstance(o, (Optimizer, DeepSpeedOptimizer))`` finds them as ``Optimizer``."""

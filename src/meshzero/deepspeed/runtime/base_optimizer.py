"""``deepspeed.runtime.base_optimizer``: the class Lightning checks optimizers against."""

from __future__ import annotations


class DeepSpeedOptimizer:
    """DeepSpeed's `deepspeed.runtime.base_optimizer.DeepSpeedOptimizer`: the marker base of
    the optimizers DeepSpeed's engine wraps; the optimizer `meshzero.deepspeed.initialize`
    returns is an instance (and still a torch.optim.Optimizer)."""

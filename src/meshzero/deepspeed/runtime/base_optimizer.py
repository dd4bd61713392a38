"""DeepSpeed's `deepspeed.runtime.base_optimizer`: the classes `isinstance` checks ask about.

The optimizer ``deepspeed.initialize`` returns is the engine's own ``torch.optim`` optimizer
whose class also derives from these (meshzero/deepspeed/engine.py), so code that asks
``isinstance(opt, (Optimizer, DeepSpeedOptimizer))`` (Lightning) finds it.
"""

from __future__ import annotations


class DeepSpeedOptimizer:
    """DeepSpeed's `deepspeed.runtime.base_optimizer.DeepSpeedOptimizer`: a base for isinstance."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's `deepspeed.runtime.base_optimizer.ZeROOptimizer`: a base for isinstance.

    Every optimizer ``deepspeed.initialize`` returns is one, at every ZeRO stage."""

"""``deepspeed.runtime.bf16_optimizer``: the class gpt-neox checks the optimizer against."""

from __future__ import annotations

from meshzero.deepspeed.runtime.base_optimizer import DeepSpeedOptimizer


class BF16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's `deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: DeepSpeed's bf16
    wrapper for stages 0-1; meshzero has no such wrapper (bf16 is the engine's compute dtype
    at every stage), so no optimizer is an instance and `isinstance` checks take their other
    branch."""

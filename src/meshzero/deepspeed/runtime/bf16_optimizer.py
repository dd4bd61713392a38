"""DeepSpeed's `deepspeed.runtime.bf16_optimizer`: the class `isinstance` checks ask about."""

from __future__ import annotations

from meshzero.deepspeed.runtime.base_optimizer import ZeROOptimizer


class BF16_Optimizer(ZeROOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's `deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: a base for isinstance.

    The optimizer ``deepspeed.initialize`` returns is one where DeepSpeed would wrap it in
    BF16_Optimizer: bf16 at ZeRO stage 1 without optimizer offload (runtime/engine.py:
    ``_do_optimizer_sanity_check``)."""

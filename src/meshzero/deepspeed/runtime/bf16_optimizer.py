"""``deepspeed.runtime.bf16_optimizer``: the class gpt-neox tests the engine's optimizer
against (``isinstance(optimizer, BF16_Optimizer)``)."""

from __future__ import annotations

from typing import Any

from meshzero.deepspeed.runtime.base_optimizer import DeepSpeedOptimizer


class BF16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's `deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: never an engine's
    optimizer here (meshzero keeps bf16 master weights in its own engine, config ``bf16``);
    building one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "BF16_Optimizer is built by DeepSpeed's engine, not by user code; in meshzero set "
            "\"bf16\": {\"enabled\": true} in the config and pass a torch optimizer")

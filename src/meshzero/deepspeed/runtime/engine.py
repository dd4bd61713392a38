"""DeepSpeed's `deepspeed.runtime.engine`: where real code imports `DeepSpeedEngine` from.

It also has DeepSpeed's optimizer and scheduler callable types."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshzero.deepspeed.engine import DeepSpeedEngine

# DeepSpeed's type aliases: what initialize(optimizer=) / (lr_scheduler=) accept as callables
DeepSpeedOptimizerCallable = Callable[[Iterable[Any]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]

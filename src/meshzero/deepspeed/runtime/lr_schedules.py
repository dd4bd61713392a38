"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule names and its warmup schedules,
which are meshzero's own (src/meshzero/schedulers.py) under DeepSpeed's keyword
``last_batch_iteration``."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from meshzero import schedulers

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
# every schedule name DeepSpeed's config accepts (accelerate reads it to decide whether the
# config or the Trainer builds the scheduler); meshzero's config builds the three warmups and
# names the fix for the other two (docs/migration-keys.md)
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


def _epoch(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "last_batch_iteration" in kwargs:
        kwargs["last_epoch"] = kwargs.pop("last_batch_iteration")
    return kwargs


class WarmupLR(schedulers.WarmupLR):
    """DeepSpeed's `deepspeed.runtime.lr_schedules.WarmupLR`: meshzero's WarmupLR (the lr of
    each step equal to DeepSpeed's)."""

    def __init__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **_epoch(kwargs))


class WarmupDecayLR(schedulers.WarmupDecayLR):
    """DeepSpeed's `deepspeed.runtime.lr_schedules.WarmupDecayLR`: meshzero's WarmupDecayLR."""

    def __init__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **_epoch(kwargs))


class WarmupCosineLR(schedulers.WarmupCosineLR):
    """DeepSpeed's `deepspeed.runtime.lr_schedules.WarmupCosineLR`: meshzero's
    WarmupCosineLR."""

    def __init__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **_epoch(kwargs))


def _refused(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"DeepSpeed's {name} schedule is not in meshzero: build the torch equivalent "
            "(torch.optim.lr_scheduler.OneCycleLR / LinearLR) on the optimizer and pass it as "
            "lr_scheduler=")

    return type(name, (), {"__init__": __init__, "__doc__": (
        f"DeepSpeed's `deepspeed.runtime.lr_schedules.{name}`: not in meshzero; raises naming "
        "torch's equivalent.")})


OneCycle = _refused("OneCycle")
LRRangeTest = _refused("LRRangeTest")

__all__ = ["LR_RANGE_TEST", "LR_SCHEDULE", "ONE_CYCLE", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR",
           "WARMUP_DECAY_LR", "WARMUP_LR", "LRRangeTest", "OneCycle", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR"]

"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's schedule types.

Accelerate asks ``type(scheduler).__name__ in VALID_LR_SCHEDULES`` to decide whether to hand a
scheduler object to ``initialize``; the config's ``scheduler`` section (docs/migration-keys.md)
is where meshzero reads these types."""

from __future__ import annotations

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
# DeepSpeed's list, in its order (deepspeed/runtime/lr_schedules.py)
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["LR_RANGE_TEST", "LR_SCHEDULE", "ONE_CYCLE", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR",
           "WARMUP_DECAY_LR", "WARMUP_LR"]

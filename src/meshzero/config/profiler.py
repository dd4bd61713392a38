"""`flops_profiler`: which step to profile and how to report it."""

from typing import Annotated

from pydantic import Field, Strict, field_validator

from meshzero.config.errors import InvalidValue
from meshzero.config.scalars import Bool, Int, NonNegFloat, PosFloat, PosInt, Section


class FlopsProfilerConfig(Section):
    """`flops_profiler`: profile one whole optimizer step (every micro-step) at profile_step:
    its FLOPs are counted in step profile_step - 1 (in profile_step itself when it is 0 or
    its inputs' shapes differ), and profile_step is timed (docs/profiling.md).

    meshzero measures activation-checkpoint recomputation, so recompute_fwd_factor (an
    assumed factor in DeepSpeed) must stay 0. peak_flops is meshzero's own key: the peak
    FLOP/s of one rank's device for MFU and HFU (default: a table of known devices matched on
    the device name; unknown on CPU). headline_steps (meshzero's own, K): the report's
    latency, throughput, MFU and HFU are the median of the last K unprofiled steps after
    step 0."""

    enabled: Bool = False
    profile_step: Annotated[Int, Field(ge=-1)] = 1  # -1: never (DeepSpeed's "off")
    module_depth: Annotated[Int, Field(ge=-1)] = -1
    top_modules: PosInt = 1
    detailed: Bool = True
    output_file: Annotated[str, Strict(), Field(min_length=1)] | None = None
    recompute_fwd_factor: NonNegFloat = 0.0
    peak_flops: PosFloat | None = None
    headline_steps: PosInt = 5

    @field_validator("recompute_fwd_factor")
    @classmethod
    def _measured(cls, value: float) -> float:
        if value != 0.0:
            raise InvalidValue("is not supported: meshzero measures recomputation (reported "
                           "separately) instead of assuming a factor; use 0")
        return value

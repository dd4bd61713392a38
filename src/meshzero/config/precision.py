"""`fp16` and `bf16`: the compute dtype and fp16's loss scaling; `data_types`."""

from typing import Annotated, Literal

from pydantic import Field

from meshzero.config.scalars import Bool, Int, NonNegFloat, PosFloat, PosInt, Section


class FP16Config(Section):
    """`fp16`: loss_scale 0 means dynamic scaling starting at 2**initial_scale_power."""

    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: Annotated[Int, Field(ge=0, le=64)] = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    min_loss_scale: PosFloat = 1.0
    consecutive_hysteresis: Bool = False
    # DeepSpeed's auto_cast casts floating inputs to fp16; meshzero always casts them to the
    # compute dtype, which is what a model with fp16 parameters needs either way
    auto_cast: Bool = False


class BF16Config(Section):
    enabled: Bool = False


class DataTypesConfig(Section):
    """`data_types`: grad_accum_dtype is the dtype gradients are held, accumulated and
    reduced in (None: DeepSpeed's default, the compute dtype; see Config.grad_dtype)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None

"""`fp16` and `bf16`: the compute dtype and fp16's loss scaling; `data_types`."""

from typing import Annotated

from pydantic import Field, Strict, field_validator

from meshzero.config.errors import InvalidValue
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
    """`data_types`: grad_accum_dtype fp32 is what meshzero does (fp32 gradient shards)."""

    grad_accum_dtype: Annotated[str, Strict()] | None = None

    @field_validator("grad_accum_dtype")
    @classmethod
    def _fp32_only(cls, value: str | None) -> str | None:
        if value not in (None, "fp32"):
            raise InvalidValue("is not supported yet: meshzero accumulates gradients in fp32 "
                               "shards (fp16/bf16 accumulation would change results); only "
                               "'fp32' is valid")
        return value

"""Strict scalar types and the base model shared by the config sections."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

from meshzero.config.errors import InvalidValue

# --- strict scalar types -------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """Accept 5e8 (JSON gives 500000000.0) as an int; refuse bools and fractional floats."""
    if isinstance(value, bool):
        raise InvalidValue("is a boolean; give an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise InvalidValue("is not a whole number; give an integer")
        return int(value)
    return value  # strict int validation then rejects strings such as "10"


Int = Annotated[int, Strict(), BeforeValidator(_integral)]
PosInt = Annotated[Int, Field(gt=0)]
NonNegInt = Annotated[Int, Field(ge=0)]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]
Beta = Annotated[Float, Field(ge=0, lt=1)]
Ratio = Annotated[Float, Field(ge=0, le=1)]
Bool = Annotated[bool, Strict()]
WarmupType = Literal["log", "linear"]


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, and a loaded config is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

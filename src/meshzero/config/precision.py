"""`fp16` and `bf16`: the compute dtype and fp16's loss scaling; `data_types`;
`torch_autocast`."""

import importlib
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, field_validator

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
    """`bf16`: bf16 compute with an fp32 master; bf16_optimizer_states keeps Adam's m and v
    in bf16 (2 + 2 bytes per element instead of 4 + 4; the arithmetic stays fp32);
    bf16_master_weights_and_grads keeps the master and the gradients in bf16 (the compute
    parameters are then the master, as in fp32 training)."""

    enabled: Bool = False
    bf16_optimizer_states: Bool = False
    bf16_master_weights_and_grads: Bool = False


class DataTypesConfig(Section):
    """`data_types`: grad_accum_dtype is the dtype gradients are held, accumulated and
    reduced in (None: DeepSpeed's default, the compute dtype; see Config.grad_dtype)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None


# DeepSpeed's DtypeEnum spellings of the autocast dtypes meshzero runs, and of the one it does not
_AUTOCAST_DTYPES = {"bfloat16": ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
                    "float16": ("fp16", "float16", "half", "torch.float16")}
_AUTOCAST_OTHER = ("fp32", "float32", "float", "torch.float32")
# DeepSpeed's default lower_precision_safe_modules
SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")


class TorchAutocastConfig(Section):
    """`torch_autocast` (DeepSpeed >= 0.16): the forward run under ``torch.autocast(dtype)``,
    from fp32 parameters, master and gradients, or with bf16.enabled from bf16 parameters
    (bf16 gradients; the master and optimizer states as bf16's keys say). ``dtype`` bfloat16
    (the default) or float16; float16 scales the loss dynamically on torch's
    ``GradScaler`` schedule (precision.py), as DeepSpeed's ZeRO optimizers and stage 0 do.
    lower_precision_safe_modules (dotted class names) must import as nn.Module classes;
    DeepSpeed also reduces those modules' gradients in the autocast dtype. Alone, meshzero
    reduces every gradient in communication_data_type (fp32 by default): more bytes, no
    extra rounding; with bf16.enabled every gradient is bf16 and reduced in bf16, as
    DeepSpeed reduces them then."""

    enabled: Bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: list[str] = Field(default_factory=lambda: list(SAFE_MODULES))

    @field_validator("dtype", mode="before")
    @classmethod
    def _half_dtypes(cls, value: Any) -> Any:
        for name, spellings in _AUTOCAST_DTYPES.items():
            if isinstance(value, str) and value.lower() in spellings:
                return name
        valid = ", ".join(s for spellings in _AUTOCAST_DTYPES.values() for s in spellings)
        if isinstance(value, str) and value.lower() in _AUTOCAST_OTHER:
            raise InvalidValue("is not supported: an fp32 autocast changes nothing; valid: "
                               f"{valid} (or torch_autocast.enabled false)")
        raise InvalidValue(f"is not a dtype; valid: {valid}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "float16" else torch.bfloat16

    @property
    def scales_loss(self) -> bool:
        """A float16 autocast: the loss is scaled (torch's GradScaler schedule)."""
        return self.enabled and self.dtype == "float16"

    @field_validator("lower_precision_safe_modules")
    @classmethod
    def _module_classes(cls, names: list[str]) -> list[str]:
        bad = [name for name in names if not _is_module_class(name)]
        if bad:
            raise InvalidValue(f"holds {bad}, which do not import as torch.nn.Module classes "
                               "(give dotted names such as 'torch.nn.Linear')")
        return names


def _is_module_class(dotted: str) -> bool:
    path, _, name = dotted.rpartition(".")
    try:
        obj = getattr(importlib.import_module(path), name) if path else None
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(obj, type) and issubclass(obj, torch.nn.Module)

"""``deepspeed.runtime``: the modules real code imports names from (engine, zero, dataloader,
config, lr_schedules, utils, ...); each submodule is imported on first use as an attribute
(``deepspeed.runtime.zero.GatheredParameters``), as DeepSpeed's eager imports allow."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__)}


def __getattr__(name: str) -> ModuleType:
    if name not in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})

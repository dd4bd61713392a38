"""``deepspeed.runtime.activation_checkpointing.checkpointing``: DeepSpeed's own path of
``deepspeed.checkpointing`` (Megatron and gpt-neox import the module by it): every name is
``meshzero.deepspeed.checkpointing``'s, the same objects."""

from __future__ import annotations

import importlib
from typing import Any

_TARGET = "meshzero.deepspeed.checkpointing"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(_TARGET), name)


def __dir__() -> list[str]:
    return dir(importlib.import_module(_TARGET))

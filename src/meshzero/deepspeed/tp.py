"""DeepSpeed's ``tp_model_init``: the tensor-parallel size recorded for ``initialize``, where
meshzero's tensor parallelism (``tensor_parallel.size``, the plan inferred from the model)
slices the model."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

# model -> the tp size its tp_model_init asked for (weak: a model let go is forgotten)
_RECORDED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype,
                  config: Any = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's `deepspeed.tp_model_init`: records ``tp_size`` for `initialize`, which
    sets the config's `tensor_parallel.size` from it (a different size there is an error);
    the model is returned cast to ``dtype``, unsliced."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): expected a positive int")
    if kwargs.get("tp_group") is not None:
        raise ValueError("tp_model_init(tp_group=...): meshzero builds the tensor-parallel "
                         "groups from its mesh; leave tp_group out")
    _RECORDED[model] = tp_size
    return model.to(dtype)


def recorded_tp_size(model: nn.Module) -> int | None:
    """The tp size `tp_model_init` recorded for ``model``, or None."""
    return _RECORDED.get(model)


def with_recorded_tp(config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``config`` with ``tensor_parallel.size`` from tp_model_init, the config canonical (a
    mismatch is an error, as DeepSpeed's merge rule)."""
    size = recorded_tp_size(model)
    if size is None:
        return config
    tp = dict(config.get("tensor_parallel") or {})
    given = tp.get("size", tp.get("autotp_size"))
    if given is not None and int(given) != size:
        raise ValueError(f"tp_model_init(tp_size={size}) but the config's tensor_parallel "
                         f"size is {given}; make them agree")
    if size == 1 and given is None:
        return config
    tp.setdefault("size", size)
    return {**config, "tensor_parallel": tp}

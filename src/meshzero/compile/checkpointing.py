"""Activation checkpointing that wraps a unit's forward, kept eager around the compiled one.

Since transformers 5, a ``GradientCheckpointingLayer`` subclass's ``forward`` is a wrapper
(``forward_with_checkpointing``, its original as ``__wrapped__``) that runs the original under
``self._gradient_checkpointing_func`` (torch.utils.checkpoint) when
``model.gradient_checkpointing_enable()`` is on. Compiled whole, dynamo traces the checkpoint
as a higher-order op and refuses the layer's side effects inside it (transformers' output
capturing context variable): one graph break per layer, the whole layer eager. So the wrapper's
decision runs here, eagerly, and only the original forward is compiled; the recompute in
backward calls the same compiled forward again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

_HF_WRAPPER = "forward_with_checkpointing"  # transformers/modeling_layers.py


def compiled_target(forward: Callable) -> tuple[Callable, bool]:
    """``(the function to compile, whether checkpointing must be run around it)``."""
    inner = getattr(forward, "__wrapped__", None)
    code = getattr(forward, "__code__", None)  # functools.wraps copies the name, not the code
    if code is not None and code.co_name == _HF_WRAPPER and callable(inner):
        return inner, True
    return forward, False


def call_checkpointed(module: nn.Module, compiled: Callable, args: tuple,
                      kwargs: dict[str, Any]) -> Any:
    """What transformers' wrapper does, with ``compiled`` as the original forward: checkpoint
    it when the layer checkpoints (training, grad enabled), with caching switched off."""
    if not (getattr(module, "gradient_checkpointing", False) and module.training
            and torch.is_grad_enabled()):
        return compiled(module, *args, **kwargs)
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):  # a cache updated again by the recompute would be wrong
        kwargs["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for key in ("cache", "layer_past"):
            if kwargs.get(key) is not None:
                kwargs[key] = None
    checkpoint: Callable = vars(module)["_gradient_checkpointing_func"]  # set by transformers
    return checkpoint(partial(compiled, module, **kwargs), *args)

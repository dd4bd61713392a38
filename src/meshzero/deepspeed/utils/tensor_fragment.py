"""``deepspeed.utils.tensor_fragment``: one parameter's fp32 value, gradient and optimizer
state by parameter, over meshzero's fragments (zero/param_values.py).

DeepSpeed (deepspeed/utils/tensor_fragment.py) reads the fp32 fragment each rank holds and
sums the fragments over the data-parallel group, so the ``full`` functions are collective
(call them on every rank) and the ``local`` ones are not. Differences, each for meshzero's
promise: they work at every stage (DeepSpeed's local functions assert ZeRO-3), ``local``
is this rank's fragment of the parameter inside its flat shard (its length is the
fragment's, not ``ceil(numel / world)``), and writing the full fp32 value writes the
compute parameters too (DeepSpeed's waits for the next step).
"""

from __future__ import annotations

import torch

from meshzero.zero import param_values
from meshzero.zero.owners import owner_of
from meshzero.zero.state import ZeroModelState

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_optimizer_state"]


def _owner(param: torch.Tensor, name: str) -> ZeroModelState:
    state = owner_of(param)
    if state is None:
        raise ValueError(f"{name}: this parameter (shape {tuple(param.shape)}) is not held by "
                         "a meshzero engine; call it on the engine's model parameters "
                         "after initialize")
    return state


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_full_fp32_param`: a whole fp32 master.

    The whole fp32 master of a parameter (collective); None for a frozen or engine-less
    one."""
    state = owner_of(param)
    if state is None:
        return None
    with state.materialized():
        return param_values.full_value(state, param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """DeepSpeed's `deepspeed.utils.safe_set_full_fp32_param`: write its fp32 value.

    Write a parameter's whole fp32 value (the same on every rank) into this rank's master
    fragment and compute params."""
    state = _owner(param, "safe_set_full_fp32_param")
    with state.materialized(True):
        param_values.set_full_value(state, param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str
                                  ) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_full_optimizer_state`: a whole optimizer state.

    The whole fp32 optimizer state ``optim_state_key`` of a parameter (collective); None if
    frozen or engine-less."""
    state = owner_of(param)
    if state is None:
        return None
    with state.materialized():
        return param_values.full_value(state, param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """DeepSpeed's `deepspeed.utils.safe_set_full_optimizer_state`: write a whole state.

    Write a parameter's whole optimizer state ``optim_state_key`` (the same on every rank)
    into this rank's fragment."""
    state = _owner(param, "safe_set_full_optimizer_state")
    with state.materialized(True):
        param_values.set_full_value(state, param, value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_full_grad`: a parameter's fp32 gradient.

    The whole fp32 gradient of a parameter, averaged as the step uses it (collective; after
    backward, before step)."""
    state = owner_of(param)
    if state is None:
        return param.grad
    return param_values.full_grad(state, param)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_local_fp32_param`: this rank's fp32 part.

    This rank's fragment of a parameter's fp32 master (1-D; not collective)."""
    state = _owner(param, "safe_get_local_fp32_param")
    with state.materialized():
        return param_values.local_value(state, param)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """DeepSpeed's `deepspeed.utils.safe_set_local_fp32_param`: write this rank's part.

    Write this rank's fragment of a parameter's fp32 master (compute params follow at the
    next step)."""
    state = _owner(param, "safe_set_local_fp32_param")
    with state.materialized(True):
        param_values.set_local_value(state, param, value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_local_grad`: this rank's part of the gradient.

    This rank's fragment of a parameter's fp32 gradient (1-D; after backward, before step)."""
    return param_values.local_grad(_owner(param, "safe_get_local_grad"), param)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str
                                   ) -> torch.Tensor | None:
    """DeepSpeed's `deepspeed.utils.safe_get_local_optimizer_state`: this rank's state part.

    This rank's fragment of a parameter's optimizer state ``optim_state_key`` (1-D; not
    collective)."""
    state = _owner(param, "safe_get_local_optimizer_state")
    with state.materialized():
        return param_values.local_value(state, param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    """DeepSpeed's `deepspeed.utils.safe_set_local_optimizer_state`: write the state part.

    Write this rank's fragment of a parameter's optimizer state ``optim_state_key``."""
    state = _owner(param, "safe_set_local_optimizer_state")
    with state.materialized(True):
        param_values.set_local_value(state, param, value, optim_state_key)

"""DeepSpeed's ``deepspeed.moe.utils``: the helpers that split MoE parameters into their own
optimizer groups (deepspeed/moe/utils.py).

An expert parameter is what DeepSpeed marks as one: ``param.allreduce is False``, with its
expert-data-parallel group in ``param.group_name`` (DeepSpeed's ``Experts`` set both; a plain
torch model may set them the same way). meshzero trains every parameter data-parallel, so
the split only makes optimizer groups (``"moe": True``, ``"name"``: the group name), which
meshzero rebuilds over its shards like any other group; it never mutates the groups given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# DeepSpeed's default cap on the parameters (elements) of one MoE optimizer group
_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's `deepspeed.moe.utils.is_moe_param`: whether ``param.allreduce`` is False."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """DeepSpeed's `deepspeed.moe.utils.has_moe_layers`: (False, 0): no MoE layer here."""
    return False, 0


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """DeepSpeed's `deepspeed.moe.utils.is_moe_param_group`: the group's ``moe`` flag."""
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """DeepSpeed's `moe.utils.split_params_into_shared_and_expert_params`: (shared, expert)."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """DeepSpeed's `moe.utils.split_params_grads_into_shared_and_expert_params`: grads.

    ``(shared grads, expert grads)`` of the parameters that have a gradient, each in its
    parameter's dtype, as DeepSpeed's.
    """
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _as_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    if not isinstance(param_groups, (list, tuple)) or not all(
            isinstance(g, dict) and "params" in g for g in param_groups):
        raise ValueError("split_params_into_different_moe_groups_for_optimizer: param_groups "
                         "must be a dict or a list/tuple of dicts with 'params', got "
                         f"{type(param_groups).__name__}")
    return [dict(g, params=list(g["params"])) for g in param_groups]


def _chunks(params: list[nn.Parameter], max_size: float | None) -> list[list[nn.Parameter]]:
    """``params`` cut in order into runs of at most ``max_size`` elements (one per param
    that is larger on its own)."""
    if max_size is None:
        return [params]
    runs: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= max_size:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Any, max_group_size: float | None = _MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """DeepSpeed's `moe.utils.split_params_into_different_moe_groups_for_optimizer`: MoE groups.

    Each group keeps its shared parameters; its expert parameters move to new groups (one
    per expert group name, with the group's hyperparameters, ``"moe": True`` and ``"name"``:
    the expert group's name), cut into runs of at most ``max_group_size`` elements. The new
    groups follow the given ones, in DeepSpeed's order.
    """
    groups = _as_list(param_groups)
    moe: list[dict[str, Any]] = []
    for group in groups:
        by_name: dict[str, list[nn.Parameter]] = {}
        shared = []
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", "experts"), []).append(p)
            else:
                shared.append(p)
        group["params"] = shared
        for name, params in by_name.items():
            for run in _chunks(params, max_group_size):
                moe.append({**group, "name": name, "moe": True, "params": run})
    return groups + moe


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """DeepSpeed's `deepspeed.moe.utils.configure_moe_param_groups`: parameters or groups, split.

    A list of parameters becomes one ``dense-params`` group, then split; a list of groups is
    split as given.
    """
    if not isinstance(model_parameters, list) or not model_parameters:
        raise ValueError("configure_moe_param_groups: model_parameters must be a non-empty "
                         "list of parameters or of param-group dicts")
    if isinstance(model_parameters[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": model_parameters, "name": "dense-params"})

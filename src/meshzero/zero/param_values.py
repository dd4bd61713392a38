"""One parameter's fp32 values, gradient and optimizer state, read or written by parameter.

The optimizer steps fp32 leaves that view this rank's fragments of each parameter
(zero/sharded_optimizer.py). These functions find a parameter's leaves through its owner
(zero/owners.py) and give, for that one parameter:

    full    the whole parameter: this rank's fragments placed at their offsets and summed
            over the ZeRO group (the fragments of the ranks partition it; at stage 0 every
            rank holds all of it and nothing moves). Collective at stages 1-3.
    local   this rank's fragments in order (1-D, possibly empty): concatenated in rank
            order they are the flattened parameter. Never collective.

Gradients are the reduced gradient shard, divided as the step divides it (by the
data-parallel size over the pre-division factor): plain torch's ``param.grad`` for the mean
loss of the global batch (times the loss scale in fp16). They exist from a backward on the
accumulation boundary until the step; outside that window reading one raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshzero.zero.units import Fragment
from meshzero.zero.write_back import Target, write_values

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup
    from meshzero.zero.state import ZeroModelState

Leaf = tuple[torch.Tensor, Fragment, "FlatGroup"]


def leaves_of(state: ZeroModelState, param: torch.Tensor) -> list[Leaf] | None:
    """``(leaf, fragment, group)`` of every optimizer leaf of ``param`` on this rank, in
    element order; None if the parameter is frozen (no master, no optimizer state)."""
    found = state.slot_of(param)
    if found is None or not found[0].trainable:
        return None
    index = state.optim_state.fragment_index
    mine = [entry for entry, p in zip(index, state.optim_state.leaf_params, strict=True)
            if p is param]
    return sorted(mine, key=lambda e: e[1].start)


def _full(state: ZeroModelState, param: torch.Tensor,
          parts: list[tuple[Fragment, torch.Tensor]]) -> torch.Tensor:
    slot = state.slot_of(param)
    assert slot is not None  # callers found its leaves
    out = torch.zeros(slot[1].numel, dtype=torch.float32, device=state.device)
    for frag, values in parts:
        out[frag.start:frag.end].copy_(values.reshape(-1))
    if state.options.stage >= 1 and state.comm.size > 1:
        state.comm.all_reduce(out, name="param_values").wait()
    return out.view(slot[1].shape)


def _state_of(state: ZeroModelState, leaf: torch.Tensor, key: str) -> torch.Tensor:
    optimizer = state.optimizer
    held = optimizer.state.get(leaf, {}) if optimizer is not None else {}
    value = held.get(key)
    if not isinstance(value, torch.Tensor) or value.numel() != leaf.numel():
        keys = sorted(k for k, v in held.items()
                      if isinstance(v, torch.Tensor) and v.numel() == leaf.numel())
        raise ValueError(f"optimizer state {key!r} not found for this parameter; states it "
                         f"holds: {keys or 'none (no step was taken yet)'}")
    return value


def _grad_scale(state: ZeroModelState) -> float:
    dp = state.comm.size * (state.replica_comm.size if state.replica_comm is not None else 1)
    return state.options.grad_predivide / dp


def _grad_of(state: ZeroModelState, leaf: Leaf) -> torch.Tensor:
    _, frag, group = leaf
    if not state.has_reduced_gradients() or group.grad is None:
        raise ValueError("gradients are only available after a backward on the gradient "
                         "accumulation boundary and before engine.step()")
    group.fresh_grad()
    a = frag.local_offset
    return group.grad[a:a + frag.numel].float() * _grad_scale(state)


def full_value(state: ZeroModelState, param: torch.Tensor,
               key: str | None = None) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (or its optimizer state ``key``), shaped like it;
    None if frozen. Collective at stages 1-3."""
    leaves = leaves_of(state, param)
    if leaves is None:
        return None
    with torch.no_grad():
        return _full(state, param, [(f, leaf if key is None else _state_of(state, leaf, key))
                                    for leaf, f, _ in leaves])


def full_grad(state: ZeroModelState, param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 gradient of ``param``; None if frozen. Collective at stages 1-3."""
    leaves = leaves_of(state, param)
    if leaves is None:
        return None
    with torch.no_grad():
        return _full(state, param, [(leaf[1], _grad_of(state, leaf)) for leaf in leaves])


def local_value(state: ZeroModelState, param: torch.Tensor,
                key: str | None = None) -> torch.Tensor | None:
    """This rank's fragments of ``param``'s fp32 master (or state ``key``), 1-D."""
    leaves = leaves_of(state, param)
    if leaves is None:
        return None
    with torch.no_grad():
        parts = [(leaf if key is None else _state_of(state, leaf, key)).reshape(-1).float()
                 for leaf, _, _ in leaves]
    return torch.cat(parts) if parts else torch.zeros(0, device=state.device)


def local_grad(state: ZeroModelState, param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragments of ``param``'s fp32 gradient, 1-D."""
    leaves = leaves_of(state, param)
    if leaves is None:
        return None
    with torch.no_grad():
        parts = [_grad_of(state, leaf) for leaf in leaves]
    return torch.cat(parts) if parts else torch.zeros(0, device=state.device)


def _check_numel(value: torch.Tensor, want: int, what: str) -> None:
    if value.numel() != want:
        raise ValueError(f"{what}: the value has {value.numel()} elements, this needs {want}")


def set_full_value(state: ZeroModelState, param: torch.Tensor, value: torch.Tensor,
                   key: str | None = None) -> None:
    """Write the whole ``value`` of ``param`` (every rank passes the same): this rank's
    fragments of its fp32 master and compute parameters, or of its optimizer state
    ``key``. Not collective. A frozen parameter is left alone."""
    found = state.slot_of(param)
    leaves = leaves_of(state, param)
    if found is None or leaves is None:
        return
    group, slot = found
    _check_numel(value, slot.numel, f"the full value of {slot.name!r}")
    flat = value.detach().reshape(-1).to(state.device, torch.float32)
    with torch.no_grad():
        if key is None:
            write_values([Target(param, slot, group)], flat)
            return
        for leaf, frag, _ in leaves:
            _state_of(state, leaf, key).copy_(flat[frag.start:frag.end])


def set_local_value(state: ZeroModelState, param: torch.Tensor, value: torch.Tensor,
                    key: str | None = None) -> None:
    """Write this rank's fragments of ``param``'s fp32 master (or optimizer state ``key``)
    from ``value``, 1-D as :func:`local_value` gives it; the compute parameters follow at the
    next step. Not collective. A frozen parameter is left alone."""
    leaves = leaves_of(state, param)
    if leaves is None:
        return
    _check_numel(value, sum(f.numel for _, f, _ in leaves), "the local value")
    flat = value.detach().reshape(-1)
    at = 0
    with torch.no_grad():
        for leaf, frag, _ in leaves:
            target = leaf if key is None else _state_of(state, leaf, key)
            target.copy_(flat[at:at + frag.numel].view_as(target))
            at += frag.numel

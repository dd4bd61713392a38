"""``requires_grad`` changed after ``initialize``: training stays what plain PyTorch gives.

torch.optim steps a parameter only when its ``.grad`` is not None. ZeRO's gradients are
flat buffers, so "no gradient" is decided here, per optimizer step, from ``requires_grad``
(the same on every rank: no communication):

* a parameter of a trainable group frozen (requires_grad False) in every backward of the
  accumulation window got no gradient: its fragments keep ``.grad`` None in the step, so
  the optimizer skips them (no moment update, no weight decay, no step count) in the same
  pass over the shard as every other fragment. Its optimizer state stays and is used again
  when it is unfrozen. A trainable parameter that is unused (or detached) still gets a zero
  gradient, as before (DESIGN.md section 3): freeze it to skip it.
* a parameter frozen at ``initialize`` lives in a frozen flat group (no master, gradient or
  optimizer state: a frozen backbone costs only its parameters). When one of its parameters
  is unfrozen, the whole group is made trainable at the next ``backward``: its master is
  taken from the current values, its gradient buffers are allocated, its fragments join the
  optimizer's param group the parameter was in at ``initialize`` (fresh state, as in a
  plain-torch loop whose optimizer holds every parameter) and the reducer hooks them. Its
  parameters still frozen are skipped as above. The group stays trainable from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from meshzero.log import warn_once
from meshzero.zero.flat_buffer import FlatGroup

logger = logging.getLogger(__name__)


class Trainability:
    """Which parameters the next step skips, and frozen groups made trainable on demand."""

    def __init__(self, groups: list[FlatGroup], *,
                 make_trainable: Callable[[FlatGroup], None]):
        """``make_trainable(group)``: gives a frozen group its optimizer side (the state)."""
        self.groups = groups
        self._make_trainable = make_trainable
        self.window_frozen: frozenset[int] = frozenset()  # frozen in every backward so far
        self.window_open = False
        self.frozen_now: frozenset[int] = frozenset()
        self.skipped: list[nn.Parameter] = []  # what the next step skips
        # frozen at initialize and passed in no param group: plain torch never steps them
        self.outside: set[int] = set()

    def before_backward(self) -> bool:
        """Promote frozen groups with an unfrozen parameter, then record which trainable
        parameters are frozen now. Returns whether this backward opened the window."""
        for g in self.groups:
            if not g.trainable and any(p.requires_grad for p in g.params):
                self._make_trainable(g)
                unstepped = [p for p in g.params if id(p) in self.outside and p.requires_grad]
                if unstepped:
                    warn_once(logger, f"{_names([g], unstepped)} unfrozen after initialize "
                              "but in no optimizer param group (model_parameters): as in "
                              "plain torch, it gets gradients and is never stepped")
        frozen = [p for g in self.groups if g.trainable for p in g.params
                  if not p.requires_grad]
        self.frozen_now = frozenset(id(p) for p in frozen)
        opened = not self.window_open
        self.window_frozen = self.frozen_now if opened else self.window_frozen & self.frozen_now
        self.window_open = True
        skip = self.window_frozen | self.outside
        self.skipped = [p for g in self.groups if g.trainable for p in g.params
                        if id(p) in skip] if skip else []
        return opened

    def close_window(self) -> None:
        """The gradients were zeroed (a step): the next backward opens a new window."""
        self.window_open = False


def _names(groups: list[FlatGroup], params: list[nn.Parameter]) -> str:
    wanted = {id(p) for p in params}
    names = [s.name for g in groups for s, p in zip(g.layout.slots, g.params, strict=True)
             if id(p) in wanted]
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more


def listed_parameters(model_parameters: Iterable[Any] | None) -> list[Any] | None:
    """``model_parameters`` with every iterator made a list (it is read twice)."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    return [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in items]


def param_group_of(model: nn.Module, optimizer: Any, model_parameters: list[Any] | None
                   ) -> dict[int, int]:
    """id(parameter) -> the index of the param group the user gave it in, frozen ones
    included; without model_parameters or an optimizer instance every parameter of the
    model is in the one group (as ``torch.optim.AdamW(model.parameters())``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [g["params"] for g in optimizer.param_groups]
    elif model_parameters is not None:
        dicts = bool(model_parameters) and isinstance(model_parameters[0], dict)
        groups = [g["params"] for g in model_parameters] if dicts else [model_parameters]
    else:
        groups = [list(model.parameters())]
    return {id(p): i for i, params in enumerate(groups) for p in params}

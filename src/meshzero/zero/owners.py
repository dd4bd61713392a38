"""Which ZeRO state owns a parameter: the lookup behind APIs that take bare parameters.

DeepSpeed's helpers take a parameter and nothing else (``GatheredParameters(model.w)``,
``safe_get_full_fp32_param(p)``); DeepSpeed finds its state through attributes it bolts on
the tensor. Here every :class:`~meshzero.zero.state.ZeroModelState` registers the
parameters it holds in a weak registry: ``owner_of(p)`` answers the state (or None), and
nothing is stored on the tensor. Entries hold weak references to the parameter and to the
state, so a dropped engine and its model are freed; dead entries are swept as new states
register (an id may then be reused, so a hit is checked against the parameter itself).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshzero.zero.state import ZeroModelState

# id(parameter) -> (weak reference to it, weak reference to the state that holds it)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_owner(state: ZeroModelState, params: Iterable[torch.Tensor]) -> None:
    """``state`` holds ``params`` (a later engine over the same parameters takes them)."""
    for key in [k for k, (p, s) in _OWNERS.items() if p() is None or s() is None]:
        del _OWNERS[key]
    ref = weakref.ref(state)
    for p in params:
        _OWNERS[id(p)] = (weakref.ref(p), ref)


def owner_of(param: torch.Tensor) -> ZeroModelState | None:
    """The live ZeRO state holding ``param``, or None (not held by any engine)."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    state = entry[1]()
    return None if state is None or state.closed else state

"""Stage 3: a released parameter is never read, wherever the model or the training loop uses it.

At rest a stage-3 parameter is a view of a flat buffer whose storage is freed. Its unit's hooks
gather it around the unit's own forward and backward, but models also touch parameters
elsewhere: a parent module using a child block's weight, a block returning its own bias, a
regularizer in the training loop, ``model.head(x)`` called outside ``forward``, a weight used
through ``.detach()``. Reading freed storage is a ``setStorage`` error at best and a SIGSEGV
at worst, so every such use is caught here and its unit gathered first:

* :class:`ShardedParameter` is the class of every sharded parameter while the engine holds it
  (``isinstance(p, nn.Parameter)`` stays true). Its ``__torch_function__`` gathers the
  parameter's unit before any op that reads the data (metadata such as ``shape``, ``numel``
  or ``.grad`` does not gather) and keeps it until the end of backward or the next step.
* :class:`SavedParameterHooks` (``saved_tensors_hooks`` around the engine's forward) marks
  every tensor autograd saves that views a gathered unit, so backward gathers that unit again
  if it was released in between (a ``.detach()``-ed weight, whose use has no gradient hook).

A gather outside a unit's own hooks is a collective: every rank must make the same uses in the
same order (the all-gather order check in ``sharded_params`` raises otherwise).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

# Tensor methods that read only metadata, never the elements: no gather for them.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
    "element_size", "is_floating_point", "is_complex", "is_contiguous", "data_ptr",
    "untyped_storage", "get_device", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "__len__", "type", "is_shared",
    "is_pinned", "__reduce_ex__", "__deepcopy__",
})

# id(param) -> (weak references to it and to the bound method that gathers its unit); weak
# so that a dropped engine and its model are freed
_OWNERS: dict[int, tuple[weakref.ref, weakref.WeakMethod]] = {}


def _reads_data(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        # attributes: only reading ``.data`` hands out the elements
        return name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data
    return name not in _METADATA


def _gather(param: nn.Parameter) -> None:
    owner = _OWNERS.get(id(param))
    on_use = owner[1]() if owner is not None and owner[0]() is param else None
    if on_use is not None:
        on_use(param)


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose storage may be released; any data use gathers it first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_data(func):
            for arg in (*args, *kwargs.values()):
                if type(arg) is cls:
                    _gather(arg)
                elif isinstance(arg, list | tuple):  # torch.cat([w, v]), torch.stack(...)
                    for item in arg:
                        if type(item) is cls:
                            _gather(item)
        # run the op on plain tensors, as nn.Parameter itself does
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def mark_sharded(param: nn.Parameter, on_use: Callable[[nn.Parameter], None]) -> None:
    """Make ``param`` gather itself through ``on_use(param)`` (a bound method, held weakly)
    before its data is read."""
    if type(param) not in (nn.Parameter, ShardedParameter):  # the latter: a second engine
        raise ValueError(f"stage 3 shards only plain nn.Parameter objects, got "
                         f"{type(param).__name__} (shape {tuple(param.shape)})")
    _OWNERS[id(param)] = (weakref.ref(param), weakref.WeakMethod(on_use))
    param.__class__ = ShardedParameter


def forget_dead() -> None:
    """Drop the entries of parameters that no longer exist (their ids may be reused)."""
    for key in [k for k, (ref, _) in _OWNERS.items() if ref() is None]:
        del _OWNERS[key]


def unmark_sharded(param: nn.Parameter) -> None:
    _OWNERS.pop(id(param), None)
    cls: type = type(param)  # compared untyped: narrowing would fix param's class statically
    if cls is ShardedParameter:
        param.__class__ = nn.Parameter


class _OnUnit:
    """A saved tensor that views unit ``unit``'s full buffer."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit: int):
        self.tensor = tensor
        self.unit = unit


class SavedParameterHooks(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for backward that view a gathered unit gather it again when unpacked.

    ``unit_of_storage(ptr)``: the unit whose full buffer has storage address ``ptr`` (None
    for any other tensor); ``ensure_gathered(unit)``: gather it if it is released."""

    def __init__(self, unit_of_storage: Callable[[int], int | None],
                 ensure_gathered: Callable[[int], None]):
        def pack(t: torch.Tensor):
            unit = unit_of_storage(t.untyped_storage().data_ptr())
            return t if unit is None else _OnUnit(t, unit)

        def unpack(saved):
            if isinstance(saved, _OnUnit):
                ensure_gathered(saved.unit)
                return saved.tensor
            return saved

        super().__init__(pack, unpack)


def output_tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside an output of any pytree shape: tuples, lists, dicts, namedtuples,
    registered nodes (Hugging Face's ModelOutput), and dataclasses, nested."""
    found = []
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found

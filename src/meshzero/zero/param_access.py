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
* DeepSpeed's stage-3 attributes, which code reads to detect ZeRO-3 (``hasattr(p,
  "ds_id")``) and drive it: ``ds_id``, ``ds_status`` (:class:`ZeroParamStatus`),
  ``ds_numel``, ``ds_shape`` and ``ds_tensor`` are properties of :class:`ShardedParameter`
  computed from the owner's own metadata (its :class:`~meshzero.zero.units.ParamSlot` and
  flat group): nothing is stored on the tensor, and a parameter no engine holds has none.
* :class:`SavedParameterHooks` (``saved_tensors_hooks`` around the engine's forward) marks
  every tensor autograd saves that views a gathered unit, so backward gathers that unit again
  if it was released in between (a ``.detach()``-ed weight, whose use has no gradient hook).

A gather outside a unit's own hooks is a collective: every rank must make the same uses in the
same order (the all-gather order check in ``sharded_params`` raises otherwise).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Callable
from typing import Any

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

# id(param) -> weak references to it, to the bound method that gathers its unit and to the
# one that describes it (ParamInfo); weak so that a dropped engine and its model are freed
_OWNERS: dict[int, tuple[weakref.ref, weakref.WeakMethod, weakref.WeakMethod | None]] = {}


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`: ds_status values.

    Whether a stage-3 parameter's full values are present, with DeepSpeed's values: core
    meshzero defines it because its ``ShardedParameter.ds_status`` answers with it."""

    AVAILABLE = 1  # gathered: the full values are in memory
    NOT_AVAILABLE = 2  # released: only this rank's shard is
    INFLIGHT = 3  # an all-gather (a prefetch) is in flight


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """What the stage-3 attributes of one parameter read (DeepSpeed's names)."""

    ds_id: int  # its position among the engine's sharded parameters (the same on every rank)
    ds_status: ZeroParamStatus
    ds_numel: int  # of the full parameter
    ds_shape: torch.Size  # of the full parameter
    ds_tensor: torch.Tensor  # its part of this rank's shard (1-D, possibly empty)


# attributes whose reading hands out the elements (the rest: shape, grad, flags)
_DATA_ATTRIBUTES = tuple(getattr(torch.Tensor, a) for a in ("data", "T", "mT", "H", "mH")
                         if hasattr(torch.Tensor, a))


def _reads_data(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return name == "__get__" and any(owner is a for a in _DATA_ATTRIBUTES)
    return name not in _METADATA


def _gather(param: nn.Parameter) -> None:
    owner = _OWNERS.get(id(param))
    on_use = owner[1]() if owner is not None and owner[0]() is param else None
    if on_use is not None:
        on_use(param)


def _info(param: nn.Parameter, name: str) -> Any:
    owner = _OWNERS.get(id(param))
    describe = owner[2]() if owner is not None and owner[0]() is param \
        and owner[2] is not None else None
    if describe is None:  # no engine holds it (any longer): no ZeRO-3 attributes
        raise AttributeError(f"{type(param).__name__!r} object has no attribute {name!r}")
    return getattr(describe(param), name)


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose storage may be released; any data use gathers it first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # traced by torch.compile only inside a compiled unit's forward, which runs while its
        # unit is gathered (zero/compile.py checks that it reads no other unit): no gather
        if _reads_data(func) and not torch.compiler.is_compiling():
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

    # DeepSpeed's ZeRO-3 attributes, read from the engine's metadata (no gather)
    @property
    def ds_id(self) -> int:
        return _info(self, "ds_id")

    @property
    def ds_status(self) -> ZeroParamStatus:
        return _info(self, "ds_status")

    @property
    def ds_numel(self) -> int:
        return _info(self, "ds_numel")

    @property
    def ds_shape(self) -> torch.Size:
        return _info(self, "ds_shape")

    @property
    def ds_tensor(self) -> torch.Tensor:
        return _info(self, "ds_tensor")


def mark_sharded(param: nn.Parameter, on_use: Callable[[nn.Parameter], None],
                 describe: Callable[[nn.Parameter], ParamInfo] | None = None) -> None:
    """Make ``param`` gather itself through ``on_use(param)`` (a bound method, held weakly)
    before its data is read; ``describe(param)`` (the same) answers its ``ds_*``."""
    if type(param) not in (nn.Parameter, ShardedParameter):  # the latter: a second engine
        raise ValueError(f"stage 3 shards only plain nn.Parameter objects, got "
                         f"{type(param).__name__} (shape {tuple(param.shape)})")
    _OWNERS[id(param)] = (weakref.ref(param), weakref.WeakMethod(on_use),
                          None if describe is None else weakref.WeakMethod(describe))
    param.__class__ = ShardedParameter


def forget_dead() -> None:
    """Drop the entries of parameters that no longer exist (their ids may be reused)."""
    for key in [k for k, (ref, *_) in _OWNERS.items() if ref() is None]:
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

        # disabled for torch.compile: autograd calls them from a compiled unit's graph too,
        # and dynamo would compile each call as a frame of its own (0.6 us each in eager)
        super().__init__(torch.compiler.disable(pack), torch.compiler.disable(unpack))


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

"""``meshzero.zero_init``: build a model with its parameters on the meta device and remember
how it was built.

    with meshzero.zero_init(config):       # or initialize(model=factory, ...)
        model = Net()                      # meta parameters: no memory held
    engine, *_ = meshzero.initialize(model=model, config=config)

Each parameter goes to the meta device as it is registered (``self.w = nn.Parameter(...)``),
before ``reset_parameters()`` runs on it; buffers stay real, so a value a constructor
computes for one (a rotary embedding's ``inv_freq``, a constant scale) is kept as it is. A
buffer computed from a meta parameter is meta too, and is initialised with its module.

The engine then materialises the model unit by unit (zero/materialize.py). To give the
same values as eager construction it needs four facts that a finished meta model no longer
shows, so they are recorded here while the model is being built:

    rng_state   the CPU generator when construction started (after the config's seed)
    draws       the generator state before every random op on a meta parameter: the
                ops also run on CPU scratch tensors, so the generator moves as in eager
                construction and each parameter's last initialisation can be replayed
                from its own state, in any order (zero/draws.py)
    completed   the order in which modules finished their ``__init__`` (a module is attached
                to its parent right after its constructor returns): the order in which
                eager construction ran their ``reset_parameters``
    creator     for every parameter and buffer, the module that registered it first: with
                tied weights (``head.weight = embed.weight``) the value eager construction
                keeps is the one its creator's init wrote

They come from torch's global module registration hooks and a ``TorchDispatchMode``,
installed only for the duration of the ``with`` block (extension points; nothing in torch
is patched); the parameter hook is also the one that returns the meta copy of each
parameter.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from meshzero.zero.draws import DrawLog, RecordDraws

InitFn = Callable[[nn.Module], None]


@dataclass(eq=False)
class ConstructionRecord:
    """How one ``zero_init`` block built its modules (weak references only: no leak)."""

    rng_state: torch.Tensor
    init_fn: InitFn | None
    draws: DrawLog = field(default_factory=DrawLog)
    completed: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    creator: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    # made real before initialize by a gathered write (zero/early.py): the engine keeps
    # their values and runs no init on the modules
    early_modules: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    early_params: weakref.WeakSet[torch.Tensor] = field(default_factory=weakref.WeakSet)

    def _note_completed(self, module: nn.Module) -> None:
        seen = self.completed.get(id(module))
        if seen is None or seen[0]() is not module:  # an id can be reused after collection
            self.completed[id(module)] = (weakref.ref(module), len(self.completed))

    def _note_creator(self, module: nn.Module, tensor: torch.Tensor) -> None:
        seen = self.creator.get(id(tensor))
        if seen is None or seen[0]() is not tensor:
            self.creator[id(tensor)] = (weakref.ref(tensor), id(module))

    def completion_index(self, module: nn.Module) -> int | None:
        """Position of ``module`` in completion order; None for a root (never attached)."""
        seen = self.completed.get(id(module))
        return seen[1] if seen is not None and seen[0]() is module else None

    def creator_of(self, tensor: torch.Tensor) -> int | None:
        """``id`` of the module that registered ``tensor`` first."""
        seen = self.creator.get(id(tensor))
        return seen[1] if seen is not None and seen[0]() is tensor else None


# module -> the record of the zero_init block that built it (weak keys: dropped with the model)
_RECORDS: weakref.WeakKeyDictionary[nn.Module, ConstructionRecord] = (
    weakref.WeakKeyDictionary())


def holders_of(param: torch.Tensor) -> list[tuple[nn.Module, str, ConstructionRecord]]:
    """Every module built under a live ``zero_init`` record that holds ``param`` directly,
    with the attribute name and the record."""
    return [(m, name, record) for m, record in list(_RECORDS.items())
            for name, q in m._parameters.items() if q is param]


def find_record(model: nn.Module) -> ConstructionRecord | None:
    """The record of the ``zero_init`` block that built ``model``, if one did."""
    for module in model.modules():
        record = _RECORDS.get(module)
        if record is not None:
            return record
    return None


def _config_seed(config: Any) -> int | None:
    if config is None:
        return None
    from meshzero.config import load_config

    return load_config(config).seed


@contextlib.contextmanager
def zero_init(
    config: Any = None,
    *,
    init_fn: InitFn | None = None,
    enabled: bool = True,
) -> Iterator[ConstructionRecord | None]:
    """Build modules with their parameters on the meta device (buffers stay real) so that
    the engine can materialise them unit by unit, each rank keeping only its shard (peak
    memory: the shards plus about one unit).

    ``config``: the ds_config (dict, JSON path or Config) the engine will get; it is
    validated here and its ``seed``, if set, seeds torch on entry, so the model has the
    values of ``torch.manual_seed(seed); model = Net()``. Without a seed the values are
    those eager construction would draw from torch's generator as it is on entry.

    ``init_fn(module)``: called for every module, in construction order (children before
    their parent), instead of ``reset_parameters()``; the modules of a unit are all real when
    it runs, and it must set the tensors each module owns directly. It can also be set after
    the block, when the model exists: ``with zero_init() as record: model = ...`` then
    ``record.init_fn = model._init_weights`` (Hugging Face models). A parameter's
    initialisation that a constructor does outside ``reset_parameters`` is lost on the meta
    device: move it there, or into ``init_fn``. Buffers keep the values the constructor gave
    them (they are re-initialised only with their module's ``reset_parameters``/``init_fn``).

    Yields the :class:`ConstructionRecord` (``None`` with ``enabled=False``, which builds
    eagerly).
    """
    if not enabled:
        yield None
        return
    seed = _config_seed(config)
    if seed is not None:
        torch.manual_seed(seed)
    record = ConstructionRecord(rng_state=torch.get_rng_state(), init_fn=init_fn)

    def on_module(parent: nn.Module, name: str, child: nn.Module | None) -> None:
        _RECORDS[parent] = record
        if child is not None:
            _RECORDS[child] = record
            record._note_completed(child)

    handles = [
        torch_module.register_module_module_registration_hook(on_module),
        # torch documents that the hook's result replaces the parameter; its stub says None
        torch_module.register_module_parameter_registration_hook(
            functools.partial(_on_parameter, record)),  # type: ignore[arg-type]
        torch_module.register_module_buffer_registration_hook(
            functools.partial(_on_buffer, record)),
    ]
    try:
        with RecordDraws(record.draws):
            yield record
    finally:
        for handle in handles:
            handle.remove()


def _to_meta(param: torch.Tensor) -> torch.Tensor:
    """A meta parameter like ``param`` (same class, requires_grad and attributes)."""
    meta = param.detach().to("meta")
    if type(param) is nn.Parameter:
        return nn.Parameter(meta, requires_grad=param.requires_grad)
    subclass: Any = type(param)
    out = subclass(meta, requires_grad=param.requires_grad)
    out.__dict__.update(param.__dict__)
    return out


def _on_parameter(record: ConstructionRecord, module: nn.Module, name: str,
                  param: torch.Tensor | None) -> torch.Tensor | None:
    """Registration hook: the parameter goes to the meta device (its real memory, not yet
    written, is freed when the constructor drops it)."""
    _RECORDS[module] = record
    if param is None:
        return None
    meta = param if param.is_meta else _to_meta(param)
    record._note_creator(module, meta)
    return None if meta is param else meta


def _on_buffer(record: ConstructionRecord, module: nn.Module, name: str,
               buffer: torch.Tensor | None) -> None:
    """Registration hook: buffers stay as the constructor made them."""
    _RECORDS[module] = record
    if buffer is not None:
        record._note_creator(module, buffer)


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def build_from_factory(factory: Callable[[], nn.Module], config: Any) -> nn.Module:
    """``factory()`` under ``zero_init(config)``; the factory must return an nn.Module."""
    with zero_init(config):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"initialize(model=...) got a callable that returned "
                         f"{type(model).__name__}; a model factory must return an nn.Module")
    return model


def is_model_factory(model: Any) -> bool:
    return callable(model) and not isinstance(model, nn.Module)


"""Materialise a meta-device model unit by unit, drawing the values eager construction would.

``ZeroModelState`` iterates ``materializer(layout)`` and builds a unit's flat groups as soon
as ``(unit, flat buffers)`` is yielded; at stage 3 only this rank's shard of them stays and
the flat buffers are freed. Peak memory is the shards plus about one unit: the unit being
built (and the root's parameters, if its modules come both before and after the blocks).

Modules are visited in construction order (see construction.py), and for each one that
directly holds meta tensors:

    allocate    its own parameters and buffers on the CPU (recurse=False). An fp32
                parameter is a view of its unit's flat fp32 buffer at its slot, so the
                values are written once, where the flat group keeps them (a unit is never
                held twice). A tied tensor that another module created gets a scratch
                tensor here, as in eager construction, where this module initialised a
                tensor of its own that the tie then discarded (the random numbers are still
                drawn)
    initialise  ``init_fn(module)`` or ``module.reset_parameters()``; each of its random
                ops on the module's tensors starts from the generator state recorded for
                that draw at construction (zero/draws.py; rank 0's, broadcast), so the
                values equal eager construction's on every rank, in any order, and no
                broadcast of them is needed. Without a record (a model the user put on the
                meta device) the generator runs on from rank 0's state, in construction
                order
    check       every floating tensor it created was written (they start as NaN)
    yield       every unit whose modules and parameters are now all real, with its flat
                buffers; once the caller has built the unit, glibc's free heap memory is
                returned to the system (malloc_trim): freed units lie between the
                long-lived shards, and glibc would otherwise keep them resident, growing
                the process by about a unit each time
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.zero.construction import (
    ConstructionRecord,
    build_from_factory,
    find_record,
    has_meta_tensors,
    is_model_factory,
)
from meshzero.zero.draws import ReplayDraws
from meshzero.zero.heap import trim_heap
from meshzero.zero.units import Layout, ParamSlot

_KINDS = ("_parameters", "_buffers")


@dataclass
class _Work:
    """One module that directly holds meta tensors: (kind, name, meta tensor) of each."""

    path: str
    module: nn.Module
    unit: int
    tensors: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.path or '<root>'!r} ({type(self.module).__name__})"


def _post_order(model: nn.Module) -> dict[int, int]:
    """id(module) -> position in post-order (children first, in registration order): the
    order eager constructors finish in when nothing else is known."""
    order: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in order:
                visit(child)
        order.setdefault(id(module), len(order))

    visit(model)
    return order


def _owning_unit(unit_index: dict[str, int], path: str) -> int:
    """The deepest unit whose subtree contains the module at ``path``."""
    while path not in unit_index:
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return unit_index[path]


def _has_nan(t: torch.Tensor) -> bool:
    """max() propagates NaN and, unlike isnan(), needs no temporary the size of ``t``
    (freed temporaries of a few MiB fragment the heap between the long-lived shards)."""
    return t.numel() > 0 and bool(t.detach().max().isnan())


def _one_unit_at_a_time(works: list[_Work], layout: Layout) -> list[_Work]:
    """``works`` (in construction order) regrouped so that each unit's modules are made real
    one after the other, the largest unit first (then in the order they complete): the
    recorded draws give every parameter its eager values in any order.

    A unit in flight costs its whole flat buffer on top of the shards built so far, so the
    peak is max over units k of (shards of the units before k + unit k). Building the largest
    first (a root holding a tied embedding of several blocks' bytes) puts it where few
    shards exist yet: the peak is then the shards plus about one of the later (smaller)
    units, not the shards plus the largest. A unit whose modules come both before and after
    the others (that same root) no longer holds its flat buffer while the others are built."""
    last = {w.unit: i for i, w in enumerate(works)}
    order = {id(w): i for i, w in enumerate(works)}
    size = {u.index: sum(g.padded_numel for g in u.groups) for u in layout.units}
    return sorted(works, key=lambda w: (-size[w.unit], last[w.unit], order[id(w)]))


class Materializer:
    """Iterate ``materializer(layout)``: ``(unit index, {group index: flat fp32 buffer})``
    in the order units become real (groups without a buffer copy their parameters)."""

    def __init__(self, model: nn.Module, record: ConstructionRecord | None, *,
                 comm: Communicator, device: torch.device, src: int,
                 restore_state: torch.Tensor | None = None):
        """``restore_state``: the generator state to leave behind (the config's seed);
        None: as it was before (a zero_init record) or where the replay ends (no record)."""
        self.model = model
        self.record = record
        self.init_fn = record.init_fn if record is not None else None
        self.comm = comm
        self.device = device
        self.src = src
        self.restore_state = restore_state
        self.replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta): (meta, real)
        # every kept value comes from a recorded draw state (a zero_init record, the
        # modules' own inits): then the order of materialisation does not change the values
        self.replays = record is not None and self.init_fn is None

    # -- planning -------------------------------------------------------------------------
    def _plan(self, layout: Layout) -> tuple[list[_Work], dict[int, int], list[int]]:
        """Modules to materialise in construction order, the creator of every meta tensor,
        and per unit the number of modules and parameters still to be made real."""
        unit_index = {u.path: u.index for u in layout.units}
        post = _post_order(self.model)
        works: list[_Work] = []
        self.holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for path, module in self.model.named_modules():
            work = _Work(path, module, _owning_unit(unit_index, path))
            for kind in _KINDS:
                for name, t in getattr(module, kind).items():
                    if t is not None and t.is_meta:
                        work.tensors.append((kind, name, t))
                        self.holders.setdefault(id(t), []).append((module, kind, name))
            early = self.record is not None and module in self.record.early_modules
            if work.tensors or (self.init_fn is not None and not early):
                works.append(work)  # init_fn sees every module not made real early

        def key(w: _Work) -> tuple[float, int]:
            done = self.record.completion_index(w.module) if self.record is not None else None
            return (math.inf if done is None else done, post[id(w.module)])

        works.sort(key=key)
        creator: dict[int, int] = {}
        for w in works:  # the recorded creator if it holds the tensor, else its first holder
            for _, _, t in w.tensors:
                recorded = self.record.creator_of(t) if self.record is not None else None
                holders = {id(m) for m, _, _ in self.holders[id(t)]}
                creator.setdefault(id(t), recorded if recorded in holders else id(w.module))
        if self.replays:
            works = _one_unit_at_a_time(works, layout)
        pending = [0] * len(layout.units)
        for w in works:
            pending[w.unit] += 1
        self.param_unit: dict[int, int] = {}
        self.slot_of: dict[int, ParamSlot] = {}  # id(meta parameter) -> its flat slot
        self.flats: dict[tuple[int, int], torch.Tensor] = {}  # (unit, group): fp32 (padded,)
        self.layout = layout
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if p.is_meta and id(p) not in self.param_unit:
                self.slot_of[id(p)] = layout.slots[name]
                self.param_unit[id(p)] = layout.slots[name].unit
                pending[layout.slots[name].unit] += 1
        return works, creator, pending

    # -- one module -------------------------------------------------------------------------
    def _materialize(self, work: _Work, creator: dict[int, int]) -> list[torch.Tensor]:
        """Allocate, initialise and check one module's own tensors; returns the metas it
        created (now real in every module that holds them)."""
        module = work.module
        created = []
        for kind, name, meta in work.tensors:
            own = creator[id(meta)] == id(module)
            if own and kind == "_parameters":
                real: torch.Tensor = nn.Parameter(self._take(meta),
                                                  requires_grad=meta.requires_grad)
            elif not own and self.replays:
                # a tie's discarded init: its draws are not replayed and the kept values
                # come from their own recorded states, so it runs on the meta tensor (no
                # scratch the size of the tensor: an embedding's, for a tied head)
                real = meta
            else:  # buffers outlive their unit; scratch tensors die after the init
                real = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype,
                                           device="cpu")
            if own:
                created.append((kind, name, meta, real))
                if real.is_floating_point():
                    real.detach().fill_(math.nan)
            getattr(module, kind)[name] = real  # scratch unless created here
        draws = self.record.draws if self.record is not None else None
        targets = [(real, draws.of(meta)) for _, _, meta, real in created
                   if draws is not None]
        kept = self._shield_early(module)
        with torch.no_grad(), ReplayDraws(targets):
            self._run_init(work, bool(created))
        module._parameters.update(kept)
        unset = [name for _, name, _, real in created if real.is_floating_point()
                 and _has_nan(real)]
        if unset:
            how = "init_fn" if self.init_fn is not None else "reset_parameters()"
            raise ValueError(
                f"{how} of module {work.label} left {unset} unset (or NaN) after "
                "materialising it from the meta device; it must set every parameter and "
                "buffer the module owns (recurse=False), or pass zero_init(init_fn=...)")
        for kind, name, meta in work.tensors:  # scratch tensors go
            if creator[id(meta)] != id(module):
                getattr(module, kind)[name] = self.real_of(meta)
        for kind, _, meta, real in created:
            final = real if kind == "_parameters" else real.to(self.device)
            self.replaced[id(meta)] = (meta, final)
            for holder, hkind, hname in self.holders[id(meta)]:
                getattr(holder, hkind)[hname] = final
        return [meta for _, _, meta, _ in created]

    def _shield_early(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """Parameters of ``module`` a gathered write made real before initialize (zero/
        early.py; a tie to another module's) are swapped for scratch copies while its init
        runs, so the written values stay; returns them by name to put back."""
        early = self.record.early_params if self.record is not None else ()
        kept = {name: p for name, p in module._parameters.items()
                if p is not None and p in early}
        for name, p in kept.items():
            module._parameters[name] = nn.Parameter(p.detach().clone(),
                                                    requires_grad=p.requires_grad)
        return kept

    def _take(self, meta: torch.Tensor) -> torch.Tensor:
        """CPU memory for a parameter: its slot of the unit's flat fp32 buffer, which the
        flat group then keeps as it is (no copy), or, for another dtype, a non-contiguous
        parameter or a group on an accelerator, a tensor of its own that the group copies."""
        slot = self.slot_of[id(meta)]
        if (meta.dtype != torch.float32 or not meta.is_contiguous()
                or self.device.type != "cpu"):
            return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
        key = (slot.unit, slot.group)
        if key not in self.flats:
            group = self.layout.units[slot.unit].groups[slot.group]
            flat = torch.empty(group.padded_numel, dtype=torch.float32)
            flat[group.numel:].zero_()  # the padding; every slot is written by its init
            self.flats[key] = flat
        return self.flats[key][slot.offset:slot.offset + slot.numel].view(meta.shape)

    def _run_init(self, work: _Work, has_own: bool) -> None:
        reset = getattr(work.module, "reset_parameters", None)
        if self.init_fn is not None:
            self.init_fn(work.module)
        elif callable(reset):
            reset()
        elif has_own:
            names = [name for _, name, _ in work.tensors]
            raise ValueError(
                f"module {work.label} was built on the meta device and holds {names}, but has "
                "no reset_parameters() to initialise them: give its class one, or build the "
                "model in `with meshzero.zero_init(config, init_fn=f)`, where f(module) sets "
                "one module's own parameters and buffers")

    def real_of(self, meta: torch.Tensor) -> torch.Tensor:
        entry = self.replaced.get(id(meta))
        return entry[1] if entry is not None and entry[0] is meta else meta

    # -- the unit stream ----------------------------------------------------------------------
    def _shared_rng_state(self) -> torch.Tensor:
        """The generator state construction started from, rank ``src``'s on every rank, as
        are the recorded states of its draws (the same count on every rank: one model)."""
        state = (self.record.rng_state if self.record is not None else torch.get_rng_state())
        draws = self.record.draws if self.record is not None else None
        states = [state, *(draws.states() if draws is not None else [])]
        if self.comm.size == 1:
            return state.clone()
        buf = torch.stack(states).to(self.device)
        self.comm.broadcast(buf, self.src).wait()
        shared = [row.clone() for row in buf.cpu()]  # set_rng_state needs its own storage
        if draws is not None:
            draws.set_states(shared[1:])
        return shared[0]

    def __call__(self, layout: Layout) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
        works, creator, pending = self._plan(layout)
        end = self.restore_state
        if end is None and self.record is not None:  # construction already drew: keep it
            end = torch.get_rng_state()
        torch.set_rng_state(self._shared_rng_state())
        try:
            yield from ((u, {}) for u, n in enumerate(pending) if n == 0)
            for work in works:
                touched = [work.unit]
                for meta in self._materialize(work, creator):
                    if id(meta) in self.param_unit:
                        touched.append(self.param_unit[id(meta)])
                ready = set()
                for u in touched:
                    pending[u] -= 1
                    if pending[u] == 0:
                        ready.add(u)
                for u in sorted(ready):
                    yield u, self._take_flats(u)  # the caller builds the unit's flat groups
                    trim_heap()
        finally:
            if end is not None:
                torch.set_rng_state(end)
        self._finish(pending)

    def _take_flats(self, unit: int) -> dict[int, torch.Tensor]:
        """The flat buffers of ``unit`` by group index; the materializer lets go of them."""
        groups = range(len(self.layout.units[unit].groups))
        return {g: self.flats.pop((unit, g)) for g in groups if (unit, g) in self.flats}

    def _finish(self, pending: list[int]) -> None:
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                if t.is_meta]
        assert not left and not any(pending), f"still on the meta device: {left}, {pending}"
        for module in self.model.modules():  # buffers that were real from the start
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)

    def remap(self, optimizer: Any, model_parameters: Iterable[Any] | None
              ) -> tuple[Any, list[Any] | None]:
        """Replace meta parameters the caller still holds (``model_parameters`` lists or
        groups, an optimizer built on the meta model) by their materialised tensors."""
        if model_parameters is not None:
            model_parameters = [
                dict(g, params=[self.real_of(p) for p in g["params"]]) if isinstance(g, dict)
                else self.real_of(g) for g in model_parameters]
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                group["params"] = [self.real_of(p) for p in group["params"]]
        return optimizer, model_parameters


def prepare_model(model: Any, config: Any, *, comm: Communicator, device: torch.device,
                  src: int) -> tuple[nn.Module, Materializer | None]:
    """The engine's module and, for a model on the meta device (built by a factory under
    ``zero_init`` here, or by the user), the materializer ZeroModelState drives."""
    # with a seed, the generator is left as the seed set it (eager: seeded after building)
    seeded = torch.get_rng_state() if config.seed is not None else None
    if is_model_factory(model):
        model = build_from_factory(model, config)
    if not isinstance(model, nn.Module):
        raise ValueError(f"initialize(model=...) needs an nn.Module or a zero-argument "
                         f"callable that builds one, got {type(model).__name__}")
    if not has_meta_tensors(model):
        return model, None
    return model, Materializer(model, find_record(model), comm=comm, device=device, src=src,
                               restore_state=seeded)

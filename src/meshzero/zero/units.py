"""Units, flat layout and shard arithmetic: the one place that knows where every element lives.

A *unit* is a module whose parameters (those not claimed by a deeper unit) are flattened into
one flat buffer per group. A group holds parameters that share ``requires_grad`` and
persistence (stage 3 keeps small parameters resident). Every later feature (offload,
checkpoints, resharding, profiling) works from the arithmetic here.

Layout of one group, world size N, shard size S (a multiple of ``ALIGN``)::

    flat  = [p0 | p1 | ... | pk | padding]      numel = N * S
    rank r owns flat[r*S : (r+1)*S]; a parameter's part inside a shard is a *fragment*.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

# Shards are padded to a multiple of 4 elements (16 bytes in fp32) so every shard starts aligned.
ALIGN = 4


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its unit, its group inside the unit and its flat offset."""

    name: str
    unit: int
    group: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fragment:
    """The part ``[start, end)`` of a flattened parameter that lies inside one rank's range.

    ``local_offset`` is where that part starts inside the rank's owned range.
    """

    slot: ParamSlot
    start: int
    end: int
    local_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class GroupLayout:
    """One flat buffer: its parameters in registration order, padded to ``num_shards * shard``."""

    unit: int
    index: int
    requires_grad: bool
    persistent: bool
    num_shards: int
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return padded_shard_numel(self.numel, self.num_shards)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer that ``rank`` owns."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def fragments(self, lo: int, hi: int) -> list[Fragment]:
        """The parts of every parameter that fall in ``[lo, hi)``, in flat order."""
        frags = []
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                frags.append(Fragment(slot, a - slot.offset, b - slot.offset, a - lo))
        return frags


@dataclass
class UnitLayout:
    """A unit: its module path and its groups."""

    index: int
    path: str
    groups: list[GroupLayout] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)


@dataclass
class Layout:
    """Every unit of a model and every parameter's slot, for one shard count."""

    units: list[UnitLayout]
    slots: dict[str, ParamSlot]
    num_shards: int

    def groups(self) -> list[GroupLayout]:
        return [g for u in self.units for g in u.groups]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)


def padded_shard_numel(numel: int, num_shards: int) -> int:
    """Shard size for ``numel`` elements over ``num_shards``: ceil, then rounded up to ALIGN."""
    if numel == 0:
        return 0
    return math.ceil(math.ceil(numel / num_shards) / ALIGN) * ALIGN


def default_units(module: nn.Module, prefix: str = "") -> list[str]:
    """Paths of the repeated blocks: children of a ModuleList/Sequential whose class occurs
    two or more times among the siblings and holds parameters. Search is top-down and stops
    at a chosen block, so the Linears inside repeated transformer blocks are not units too."""
    counts = Counter(type(c) for c in module.children())
    container = isinstance(module, nn.ModuleList | nn.Sequential)
    paths = []
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        has_params = any(True for _ in child.parameters())
        if container and counts[type(child)] >= 2 and has_params:
            paths.append(path)
        else:
            paths.extend(default_units(child, path))
    return paths


# modules marked as whole units (mark_whole_unit); weak: dropped with their model
_WHOLE_UNITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_whole_unit(module: nn.Module, whole: bool = True) -> None:
    """Make ``module`` one unit, gathered whole (no unit inside it), whatever the unit
    policy chooses; ``whole=False`` removes the mark. Set before ``meshzero.initialize``:
    an MoE block whose experts run data-dependently is the usual case (every rank must
    gather the same units in the same order, and a whole block is one gather)."""
    if whole:
        _WHOLE_UNITS.add(module)
    else:
        _WHOLE_UNITS.discard(module)


def is_whole_unit(module: nn.Module) -> bool:
    """Whether ``module`` is marked by :func:`mark_whole_unit`."""
    return module in _WHOLE_UNITS


def _apply_whole_units(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` with every marked module a unit and no unit inside a marked one (the
    outermost mark wins), in pre-order."""
    marked = [p for p, m in model.named_modules() if p and m in _WHOLE_UNITS]
    if not marked:
        return paths
    outer = [p for p in marked if not any(p.startswith(q + ".") for q in marked)]
    kept = set(outer) | {p for p in paths
                         if not any(p.startswith(q + ".") for q in outer)}
    return ["", *(p for p, _ in model.named_modules() if p and p in kept)]


def choose_units(model: nn.Module, unit_classes: list[str] | None = None) -> list[str]:
    """Module paths of the units in pre-order; the root (``""``) is always first.

    ``unit_classes`` names classes (``type(m).__name__``) whose every instance becomes a unit;
    by default the repeated blocks of the model (see :func:`default_units`). Modules marked
    by :func:`mark_whole_unit` are units in either case, with no unit inside them.
    """
    if unit_classes is None:
        return _apply_whole_units(model, ["", *default_units(model)])
    names = set(unit_classes)
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - present)
    if missing:
        raise ValueError(
            f"zero_optimization.unit_classes = {sorted(names)}: no module of class "
            f"{missing} in the model; classes present: {sorted(present)}"
        )
    return _apply_whole_units(
        model, ["", *(p for p, m in model.named_modules() if p and type(m).__name__ in names)])


def _owner(unit_paths: list[str], module_path: str) -> str:
    """The deepest unit whose subtree contains ``module_path``."""
    best = ""
    for up in unit_paths:
        inside = up == "" or module_path == up or module_path.startswith(up + ".")
        if inside and len(up) > len(best):
            best = up
    return best


def _common_unit(unit_paths: list[str], owners: list[str]) -> str:
    """The deepest unit that is an ancestor-or-self of every unit in ``owners``."""
    parts = [o.split(".") if o else [] for o in owners]
    prefix: list[str] = []
    for segs in zip(*parts, strict=False):  # stops at the shortest path
        if len(set(segs)) != 1:
            break
        prefix.append(segs[0])
    return _owner(unit_paths, ".".join(prefix))


def check_no_lazy_parameters(model: nn.Module) -> None:
    """ValueError naming the first module whose parameters a lazy module (``nn.LazyLinear``)
    has not created yet: they get their shape in the first forward, and ZeRO lays out every
    parameter at initialize."""
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise ValueError(
                    f"module {path or '<root>'!r} ({type(module).__name__}) has an "
                    f"uninitialized parameter {name!r} (a lazy module): run one forward "
                    "on an example batch before meshzero.initialize, so every parameter "
                    "has its shape")


def build_layout(
    model: nn.Module,
    *,
    num_shards: int,
    unit_classes: list[str] | None = None,
    persistence_threshold: int | None = None,
) -> Layout:
    """Assign every parameter to a unit and a group, and compute its flat offset.

    Tied parameters belong to the lowest common unit of all modules that hold them.
    ``persistence_threshold``: parameters with at most this many elements go to a persistent
    group (stage 3); ``None`` makes every group persistent (stages 0-2).
    """
    unit_paths = choose_units(model, unit_classes)
    holders: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {param.dtype}; only floating "
                             "point parameters can be sharded")
        module_path = name.rsplit(".", 1)[0] if "." in name else ""
        holders.setdefault(id(param), []).append(_owner(unit_paths, module_path))
        first_name.setdefault(id(param), name)
        tensors[id(param)] = param

    units = [UnitLayout(i, p) for i, p in enumerate(unit_paths)]
    index_of = {p: i for i, p in enumerate(unit_paths)}
    group_of: dict[tuple[int, bool, bool], GroupLayout] = {}
    slots: dict[str, ParamSlot] = {}
    for pid, owners in holders.items():  # registration order (dicts keep insertion order)
        param, name = tensors[pid], first_name[pid]
        unit = index_of[_common_unit(unit_paths, owners)]
        persistent = persistence_threshold is None or param.numel() <= persistence_threshold
        key = (unit, param.requires_grad, persistent)
        if key not in group_of:
            group = GroupLayout(unit, len(units[unit].groups), param.requires_grad, persistent,
                                num_shards)
            units[unit].groups.append(group)
            group_of[key] = group
        group = group_of[key]
        slot = ParamSlot(name, unit, group.index, group.numel, param.numel(), tuple(param.shape))
        group.slots.append(slot)
        slots[name] = slot
    return Layout(units, slots, num_shards)

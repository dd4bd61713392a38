"""``deepspeed.utils.z3_leaf_module``: ZeRO-3 leaf modules are meshzero units gathered whole.

DeepSpeed stops its per-module hooks at a leaf module and gathers all its parameters at
once (deepspeed/utils/z3_leaf_module.py, used for MoE blocks whose experts run
data-dependently). In meshzero a unit is one gather, so a leaf is a module marked as a
whole unit (``meshzero.zero.units.mark_whole_unit``): a unit itself, with no unit inside
it. Mark before ``initialize``; marks are held weakly, nothing is set on the module.
"""

from __future__ import annotations

from torch import nn

from meshzero.zero.units import is_whole_unit, mark_whole_unit

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module"]


def _matches(module: nn.Module, classes: list[type | str]) -> bool:
    cls = type(module)
    full = f"{cls.__module__}.{cls.__qualname__}"
    return any(isinstance(module, c) if isinstance(c, type) else c in (cls.__name__, full)
               for c in classes)


def _mark(model: nn.Module, classes: list[type | str], whole: bool,
          raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, type | str)]
    if bad:
        raise ValueError(f"leaf_module_classes must be classes or class names, got {bad}")
    found = [m for m in model.modules() if _matches(m, list(classes))]
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"no module of class {list(classes)} in the model; classes present: "
                         f"{present}")
    for m in found:
        mark_whole_unit(m, whole)
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """DeepSpeed's `deepspeed.utils.set_z3_leaf_modules`: mark modules as whole units.

    Mark every module of these classes as one meshzero unit gathered whole (before
    initialize); returns them."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """DeepSpeed's `deepspeed.utils.unset_z3_leaf_modules`: remove whole-unit marks.

    Remove the whole-unit mark from every module of these classes; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """DeepSpeed's `deepspeed.utils.get_z3_leaf_modules`: the modules marked whole.

    The modules of ``model`` marked as whole units."""
    return [m for m in model.modules() if is_whole_unit(m)]


def z3_leaf_module(model: nn.Module) -> bool:
    """DeepSpeed's `deepspeed.utils.z3_leaf_module`: whether a module is marked whole.

    Whether a module is marked as a whole unit."""
    return is_whole_unit(model)

"""DeepSpeed's Python API on meshzero: ``import meshzero.deepspeed as deepspeed``.

Each public name is DeepSpeed's, mapped onto meshzero's own API (docs/migration.md has the
table, generated from these modules). It is a map, not a second engine: nothing else in
meshzero imports this package. Where DeepSpeed behaves badly (a pickle, a silent drop) the
name keeps meshzero's promise and its docstring says so in one line; a name that cannot be
honoured raises one line naming the meshzero way.

The names are imported on first use (PEP 562), as ``meshzero``'s are.
"""

from __future__ import annotations

import importlib
from typing import Any

# The DeepSpeed release whose source this module was written against and whose API level it
# implements: DeepSpeed version gates (``version.parse(deepspeed.__version__) >= ...``) ask it.
__version__ = "0.19.6"
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("."))

# public name -> "module" (the name is that module's attribute) or "module:" (the module)
_EXPORTS = {
    "initialize": "meshzero.deepspeed.entry",
    "DeepSpeedEngine": "meshzero.deepspeed.engine",
    "init_distributed": "meshzero.deepspeed.comm",
    "tp_model_init": "meshzero.deepspeed.tp",
    "add_config_arguments": "meshzero.deepspeed.arguments",
    "add_tuning_arguments": "meshzero.deepspeed.arguments",
    "DeepSpeedConfig": "meshzero.deepspeed.runtime.config",
    "DeepSpeedConfigError": "meshzero.deepspeed.runtime.config",
    "DeepSpeedDataLoader": "meshzero.deepspeed.runtime.dataloader",
    "get_accelerator": "meshzero.deepspeed.accelerator",
    "logger": "meshzero.deepspeed.utils.logging",
    "log_dist": "meshzero.deepspeed.utils.logging",
    "zero": "meshzero.deepspeed.zero:",
    "comm": "meshzero.deepspeed.comm:",
    "ops": "meshzero.deepspeed.ops:",
    "checkpointing": "meshzero.deepspeed.checkpointing:",
    "utils": "meshzero.deepspeed.utils:",
    "accelerator": "meshzero.deepspeed.accelerator:",
    "runtime": "meshzero.deepspeed.runtime:",
    "moe": "meshzero.deepspeed.moe:",
    "pipe": "meshzero.deepspeed.pipe:",
    "checkpoint": "meshzero.deepspeed.checkpoint:",
    "PipelineModule": "meshzero.deepspeed.pipe",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def lazy_attribute(exports: dict[str, str], package: str, name: str) -> Any:
    """The attribute ``name`` of a package whose ``exports`` map names to modules."""
    target = exports.get(name)
    if target is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    if target.endswith(":"):
        return importlib.import_module(target[:-1])
    return getattr(importlib.import_module(target), name)


def __getattr__(name: str) -> Any:
    value = lazy_attribute(_EXPORTS, __name__, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

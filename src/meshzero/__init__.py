"""meshzero: ZeRO sharded data parallelism on PyTorch that reports what each rank really holds.

The public names are imported on first use (PEP 562), so ``import meshzero``, ``meshzero
--version`` and ``meshzero --help`` do not pay for importing torch.

A process that has imported torch before meshzero is a training script: there the engine is
imported at once, with what it pulls in (pydantic, torch.distributed, and torch._dynamo with
sympy, which ``torch.optim`` imports on its first call: about 94 MB and 1-2 s, whatever the
model). The process pays this once either way; paid here, it is not counted in the memory
peak of building the first engine, which is then the model's own (docs/models.md).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the one source: pyproject.toml reads it (tool.setuptools.dynamic)

# public name -> the module that defines it
_EXPORTS = {
    "Config": "meshzero.config",
    "ConfigError": "meshzero.config",
    "load_config": "meshzero.config",
    "Engine": "meshzero.engine",
    "initialize": "meshzero.engine",
    "zero_init": "meshzero.zero.construction",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from meshzero.config import Config, ConfigError, load_config
    from meshzero.engine import Engine, initialize
    from meshzero.zero.construction import zero_init

__all__ = ["Config", "ConfigError", "Engine", "initialize", "load_config", "zero_init",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "torch" in sys.modules:  # a training script (see above), not the command line
    importlib.import_module("meshzero.engine")

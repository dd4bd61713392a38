"""meshzero: ZeRO sharded data parallelism on PyTorch that reports what each rank really holds."""

from meshzero.config import Config, ConfigError, load_config
from meshzero.engine import Engine, initialize
from meshzero.zero.construction import zero_init

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Engine", "initialize", "load_config", "zero_init",
           "__version__"]

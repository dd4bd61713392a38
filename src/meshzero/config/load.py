"""`load_config`: a dict, a JSON file or a `Config` in, a validated `Config` or one
`ConfigError` listing every problem out."""

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshzero.config.errors import ConfigError, auto_message, describe, find_auto, read_json, report
from meshzero.config.schema import Config


def load_config(config: Config | dict[str, Any] | str | os.PathLike[str]) -> Config:
    """Validate a ds_config given as a dict, a path to a JSON file or a `Config`."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        raw, source = read_json(Path(config)), f"config file '{config}'"
    elif isinstance(config, dict):
        raw, source = config, "config"
    else:
        raise ConfigError(f"expected a dict, a JSON file path or a Config, got {type(config)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(raw).__name__}")
    auto = [auto_message(key) for key in find_auto(raw, "")]
    if auto:
        raise ConfigError(report(source, auto))
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            report(source, [describe(e, raw, Config) for e in exc.errors()])) from None

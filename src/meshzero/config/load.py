"""`load_config`: a dict, a JSON file or a `Config` in, a validated `Config` or one
`ConfigError` listing every problem out."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshzero.config.compat import drop_auto, hidden_size_of, normalize
from meshzero.config.errors import ConfigError, auto_message, describe, read_json, report
from meshzero.config.schema import Config


def load_config(config: Config | dict[str, Any] | str | os.PathLike[str], *,
                model: Any = None, tp_plan: Callable[[], str | None] | None = None) -> Config:
    """Validate a ds_config given as a dict, a path to a JSON file or a `Config`.

    DeepSpeed's aliases, hints and no-op values are accepted (config.compat). "auto" values
    are resolved as Hugging Face's integration resolves them where the inputs are known: batch
    keys from each other, and with `model` (its config's hidden size) the bucket sizes and the
    persistence threshold; every other "auto" is refused, with every other problem, in one
    `ConfigError`. `tp_plan` infers a tensor-parallel plan for AutoTP's autotp_size."""
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
    norm = normalize(raw, hidden_size_of(model) if model is not None else None, tp_plan)
    problems = norm.problems + [auto_message(key) for key in norm.auto]
    drop_auto(norm.raw, norm.auto)  # the schema then reports only the other problems
    try:
        validated = Config.model_validate(norm.raw)
    except ValidationError as exc:
        problems += [line for e in exc.errors()
                     if not _about_auto(line := describe(e, norm.raw, Config), norm.auto)]
    if problems:
        raise ConfigError(report(source, problems))
    validated._hints = tuple(norm.hints)
    validated._deprecations = tuple(norm.deprecations)
    return validated


def _about_auto(line: str, auto: list[str]) -> bool:
    """A schema complaint caused by removing an "auto" key (a required key now missing)."""
    return "required" in line and any(key.split("[")[0] in line for key in auto)

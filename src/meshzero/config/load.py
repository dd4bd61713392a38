"""`load_config`: a dict, a JSON file or a `Config` in, a validated `Config` or one
`ConfigError` listing every problem out."""

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshzero.config.auto import is_auto, model_facts
from meshzero.config.compat import drop_auto, normalize
from meshzero.config.errors import ConfigError, auto_message, describe, read_json, report
from meshzero.config.ignored import drop_ignored
from meshzero.config.schema import Config

logger = logging.getLogger(__name__)


def load_config(config: Config | dict[str, Any] | str | os.PathLike[str], *,
                model: Any = None, tp_plan: Callable[[], str | None] | None = None) -> Config:
    """Validate a ds_config given as a dict, a path to a JSON file or a `Config`.

    DeepSpeed's aliases, hints, retired keys and no-op values are accepted (config.compat),
    and an unknown top-level key that is no misspelling is ignored with a warning, as
    DeepSpeed ignores it (config.ignored). "auto" is resolved as Hugging Face's Trainer and
    Accelerate resolve it without their arguments (config.auto); with `model`, the values
    the model decides (its hidden size, its parameters' dtype). `tp_plan` infers a
    tensor-parallel plan for AutoTP's autotp_size. A `Config` loaded without the model it
    needed is resolved again when `model` is given. Every problem is in one `ConfigError`."""
    if isinstance(config, Config):
        pending = config._needs_model
        # (a copy changed with model_copy keeps the dict but not the values: kept as it is)
        if pending is None or model is None or pending[1] != config.model_dump():
            return config
        return load_config(pending[0], model=model, tp_plan=tp_plan)
    if isinstance(config, (str, os.PathLike)):
        raw, source = read_json(Path(config)), f"config file '{config}'"
    elif isinstance(config, dict):
        raw, source = config, "config"
    else:
        raise ConfigError(f"expected a dict, a JSON file path or a Config, got {type(config)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(raw).__name__}")
    norm = normalize(raw, model_facts(model) if model is not None else None, tp_plan)
    ignored, misspelt = drop_ignored(norm.raw)
    problems = norm.problems + misspelt + [auto_message(key) for key in norm.auto]
    drop_auto(norm.raw, norm.auto)  # the schema then reports only the other problems
    micro = "train_micro_batch_size_per_gpu"  # "auto" with nothing to derive it from yet
    micro_pending = is_auto(raw.get(micro)) and micro not in norm.raw and \
        "train_batch_size" not in norm.raw
    try:
        validated = Config.model_validate(norm.raw,
                                          context={"micro_batch_pending": micro_pending})
    except ValidationError as exc:
        problems += [line for e in exc.errors()
                     if not _about_auto(line := describe(e, norm.raw, Config), norm.auto)]
    if problems:
        raise ConfigError(report(source, problems))
    validated._hints = tuple(norm.hints)
    validated._deprecations = tuple(norm.deprecations)
    validated._auto_resolved = tuple(norm.resolved)
    validated._warnings = tuple(norm.warnings + ignored)
    validated._micro_batch_pending = micro_pending
    if norm.needs_model and model is None:
        validated._needs_model = (copy.deepcopy(raw), validated.model_dump())
    return validated


def _about_auto(line: str, auto: list[str]) -> bool:
    """A schema complaint caused by removing an "auto" key (a required key now missing)."""
    return "required" in line and any(key.split("[")[0] in line for key in auto)


def log_accepted(config: Config) -> None:
    """One INFO line for the DeepSpeed hints the config holds, one for deprecations, one
    per "auto" resolved (the log's rank filter keeps them to rank 0), and one WARNING per
    key read and ignored."""
    if config.hints:
        logger.info("accepted DeepSpeed keys that change nothing here: %s",
                    "; ".join(config.hints))
    if config.deprecations:
        logger.info("deprecated DeepSpeed spellings: %s", "; ".join(config.deprecations))
    for line in config.auto_resolved:  # one line per "auto" filled (config.auto)
        logger.info("%s", line)
    for line in config.warnings:
        logger.warning("%s", line)

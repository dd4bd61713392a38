"""Turning config problems into one readable error: dotted keys, values given, what is valid."""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from meshzero.config.compat import deepspeed_keys
from meshzero.config.unsupported import UNSUPPORTED_KEYS


class ConfigError(ValueError):
    """A config meshzero cannot run; the message lists every problem, one per line."""


class InvalidValue(ValueError):
    """A validator's complaint worded to follow "<key> = <value> ", e.g. "is not supported"."""


def read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno} (char {exc.pos})"
        ) from None


def auto_message(key: str) -> str:
    return (
        f"config key '{key}' is 'auto': meshzero fills 'auto' where Hugging Face's Trainer or "
        "Accelerate would (docs/migration-keys.md lists each key and its rule), and this one "
        "has no value without a run; replace it with a value (meshzero.hf.MeshzeroTrainer "
        "fills the Trainer's keys from its TrainingArguments)"
    )


def _join_key(prefix: str, part: Any) -> str:
    if isinstance(part, int):
        return f"{prefix}[{part}]"
    return f"{prefix}.{part}" if prefix else str(part)


def _dotted(loc: tuple[Any, ...]) -> str:
    return functools.reduce(_join_key, loc, "")


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(error: ErrorDetails, raw: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for one pydantic error: dotted key, value given, what is valid."""
    loc, key = error["loc"], _dotted(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if error["type"] == "extra_forbidden":
        return _unknown_key_message(loc, raw, root)
    if error["type"] == "missing":
        return f"{key} is required but missing"
    if not loc:  # a check across several keys; its message names them
        return str(cause) if cause is not None else error["msg"]
    if cause is not None and str(cause).startswith(key + "."):  # a cross-key check below key
        return str(cause)
    if isinstance(cause, InvalidValue):
        return f"{key} = {_show(error['input'])} {cause}"
    return f"{key} = {_show(error['input'])}: {cause if cause is not None else error['msg']}"


def _unknown_key_message(loc: tuple[Any, ...], raw: dict[str, Any],
                         root: type[BaseModel]) -> str:
    key = _dotted(loc)
    if key in UNSUPPORTED_KEYS:
        return (
            f"config key '{key}' asks for a DeepSpeed feature meshzero does not "
            f"implement yet and that would change results ({UNSUPPORTED_KEYS[key]}); remove it "
            "or switch it off"
        )
    valid = _valid_keys(loc[:-1], raw, root)
    prefix = _dotted(loc[:-1])
    # DeepSpeed keys accepted outside the schema are near-misses too (round_robin_gradient)
    known = {k.rsplit(".", 1)[-1] for k in [*deepspeed_keys(), *UNSUPPORTED_KEYS]
             if (k.rsplit(".", 1)[0] if "." in k else "") == prefix}
    close = difflib.get_close_matches(str(loc[-1]), [*valid, *sorted(known)], n=1)
    if close:
        return f"unknown config key '{key}'; did you mean '{_join_key(prefix, close[0])}'?"
    return f"unknown config key '{key}'; valid keys at '{prefix or '<top>'}': {', '.join(valid)}"


def _valid_keys(parent: tuple[Any, ...], raw: dict[str, Any], root: type[BaseModel]) -> list[str]:
    """Field names of the model that validated the dict at `parent`."""
    model: type[BaseModel] | None = root
    node: Any = raw
    for part in parent:
        owner, node = node, node.get(part) if isinstance(node, dict) else None
        if model is None:
            return []
        if part == "params" and hasattr(model, "params_model"):  # a typed section
            model = model.params_model(owner.get("type"))
        else:
            model = _submodel(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else []


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):  # `Model | None`
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def report(source: str, problems: list[str]) -> str:
    lines = [line for problem in problems for line in problem.split("\n")]
    noun = "problem" if len(lines) == 1 else "problems"
    return f"invalid meshzero {source} ({len(lines)} {noun}):\n" + "\n".join(
        f"  - {line}" for line in lines
    )

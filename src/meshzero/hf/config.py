"""ds_config "auto" values resolved from Hugging Face ``TrainingArguments``.

The Trainer owns the loop (batching, accumulation, clipping request, lr schedule length), so
the config the engine runs must agree with the arguments: an "auto" value takes the
argument's value, and a number that disagrees with an argument the loop depends on is an
error naming both, before any work. The mapping is the one Hugging Face documents for its
DeepSpeed integration:

    train_micro_batch_size_per_gpu   per_device_train_batch_size
    gradient_accumulation_steps      gradient_accumulation_steps
    train_batch_size                 world_size * micro batch * accumulation
    gradient_clipping                max_grad_norm
    optimizer.params                 lr, betas (adam_beta1, adam_beta2), eps, weight_decay
    scheduler.params                 warmup_min_lr 0, warmup_max_lr lr, warmup_num_steps,
                                     total_num_steps (the Trainer's max_steps)
    fp16.enabled / bf16.enabled      fp16 / bf16
    zero_optimization buckets        hidden_size**2, 0.9 * hidden_size**2, 10 * hidden_size

The Trainer's ``torch_compile`` arguments become the config's "compile" section
(``resolve_compile``): the engine compiles each ZeRO unit, so the Trainer (Accelerate's
dynamo plugin) never wraps the engine in a second ``torch.compile``:

    compile.enabled                  torch_compile (or a torch_compile_backend / _mode given)
    compile.backend                  torch_compile_backend ("inductor" unless given)
    compile.kwargs.mode              torch_compile_mode (when given)

Every other "auto" Hugging Face or Accelerate fill (Accelerate's
stage3_gather_16bit_weights_on_model_save, the offload devices, ...) is left for
``load_config`` to fill with their defaults (meshzero.config.auto).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from meshzero.config import ConfigError

# dotted key -> (value from the arguments, whether a number there must equal it)
Resolved = dict[str, tuple[Any, bool]]


def read_raw_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A private deep copy of a ds_config dict, or the parsed JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"meshzero_config must be a dict or a JSON file path, got "
                          f"{type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"meshzero_config file '{path}' does not exist")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ConfigError(f"meshzero_config file '{path}' must hold a JSON object")
    return raw


def argument_values(args: Any, *, world_size: int, max_steps: int | None,
                    hidden_size: int | None, sequence_parallel: int = 1) -> Resolved:
    """What each key takes from ``TrainingArguments`` (``args``) and the run. Under sequence
    parallelism the ranks of an sp group train on their micro-batches together, so the
    engine's micro batch is sp x per_device_train_batch_size."""
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values: Resolved = {
        "train_micro_batch_size_per_gpu": (micro * sequence_parallel, True),
        "gradient_accumulation_steps": (accum, True),
        "train_batch_size": (world_size * micro * accum, True),
        "gradient_clipping": (args.max_grad_norm, True),
        "fp16.enabled": (bool(args.fp16), True),
        "bf16.enabled": (bool(args.bf16), True),
        "optimizer.params.lr": (args.learning_rate, True),
        "optimizer.params.betas": ([args.adam_beta1, args.adam_beta2], True),
        "optimizer.params.eps": (args.adam_epsilon, True),
        "optimizer.params.weight_decay": (args.weight_decay, True),
        "scheduler.params.warmup_min_lr": (0.0, False),
        "scheduler.params.warmup_max_lr": (args.learning_rate, True),
    }
    if max_steps is not None:
        values["scheduler.params.warmup_num_steps"] = (args.get_warmup_steps(max_steps), False)
        values["scheduler.params.total_num_steps"] = (max_steps, False)
    if hidden_size is not None:
        h2 = hidden_size * hidden_size
        values["zero_optimization.reduce_bucket_size"] = (h2, False)
        values["zero_optimization.stage3_prefetch_bucket_size"] = (int(0.9 * h2), False)
        values["zero_optimization.stage3_param_persistence_threshold"] = (10 * hidden_size,
                                                                          False)
    return values


def resolve_auto(raw: dict[str, Any], values: Resolved) -> dict[str, Any]:
    """``raw`` with every "auto" in ``values`` replaced and every required agreement checked.

    A key in ``values`` that ``raw`` leaves out is filled for the batch keys and a precision
    the arguments turn on (the loop depends on them); the others keep meshzero's defaults.
    An "auto" nothing resolves is left for ``load_config`` to refuse with its own message."""
    out = copy.deepcopy(raw)
    problems = []
    for key, (value, must_match) in values.items():
        if key in _FILLED and value is not False and "." in key:
            out.setdefault(key.split(".")[0], {})  # "bf16": {...} for bf16=True
        parent, leaf = _parent(out, key)
        if parent is None or leaf not in parent:
            if parent is not None and key in _FILLED and value is not False:
                parent[leaf] = value
            continue
        given = parent[leaf]
        if isinstance(given, str) and given.strip().lower() == "auto":
            parent[leaf] = value
        elif must_match and not _same(given, value):
            problems.append(f"config key '{key}' = {given!r} disagrees with the Trainer's "
                            f"arguments ({_ARG_NAMES.get(key, key)} gives {value!r}); set it "
                            "to \"auto\" or to the same value")
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def resolve_compile(raw: dict[str, Any], args: Any) -> dict[str, Any]:
    """``raw`` with its "compile" section agreeing with the Trainer's ``torch_compile``,
    ``torch_compile_backend`` and ``torch_compile_mode``: "auto" takes the argument, a missing
    key is filled when the arguments turn compile on, a value that disagrees is an error
    naming both (all of them in one error). With ``torch_compile`` off, a section that turns
    compile on by itself is kept: the engine compiles, the Trainer does not."""
    out = copy.deepcopy(raw)
    on = bool(getattr(args, "torch_compile", False))
    if "compile" not in out and not on:
        return out
    section = out.setdefault("compile", {})
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'compile' must be an object, got {section!r}")
    mode = getattr(args, "torch_compile_mode", None)
    wanted = {"enabled": ("torch_compile", on),
              "backend": ("torch_compile_backend",
                          getattr(args, "torch_compile_backend", None) or "inductor")}
    problems = [_agree(section, key, arg, value, fill=on) for key, (arg, value) in wanted.items()]
    kwargs = section.get("kwargs")
    if on and mode is not None:
        kwargs = section.setdefault("kwargs", {}) if kwargs is None else kwargs
    if isinstance(kwargs, dict):
        problems.append(_agree(kwargs, "mode", "torch_compile_mode", mode,
                               fill=on and mode is not None, prefix="kwargs."))
    if errors := [p for p in problems if p]:
        raise ConfigError("\n".join(errors))
    return out


def _agree(section: dict[str, Any], key: str, arg: str, value: Any, *, fill: bool,
           prefix: str = "") -> str | None:
    """Resolve ``section[key]`` against the argument ``arg`` = ``value``; a problem or None."""
    given = section.get(key)
    if isinstance(given, str) and given.strip().lower() == "auto":
        if value is None:  # no mode given: leave the backend's default
            del section[key]
        else:
            section[key] = value
    elif key not in section:
        if fill:
            section[key] = value
    elif fill and given != value:
        return (f"config key 'compile.{prefix}{key}' = {given!r} disagrees with the Trainer's "
                f"arguments ({arg} gives {value!r}); set it to \"auto\" or to the same value")
    return None


# filled when the config leaves them out (fp16/bf16 only when the arguments turn them on)
_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "train_batch_size", "fp16.enabled", "bf16.enabled")
_ARG_NAMES = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "train_batch_size": "world_size * per_device_train_batch_size * "
                        "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm", "fp16.enabled": "fp16", "bf16.enabled": "bf16",
    "optimizer.params.lr": "learning_rate", "scheduler.params.warmup_max_lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1, adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
}


def _parent(root: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding the last part of dotted ``key``, and that part."""
    *path, leaf = key.split(".")
    node: Any = root
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None, leaf
        node = node[part]
    return (node if isinstance(node, dict) else None), leaf


def _same(given: Any, value: Any) -> bool:
    if isinstance(value, list):
        return isinstance(given, (list, tuple)) and len(given) == len(value) and all(
            _same(g, v) for g, v in zip(given, value, strict=True))
    if isinstance(value, bool) or isinstance(given, bool):
        return bool(given) == bool(value)
    if isinstance(given, (int, float)) and isinstance(value, (int, float)):
        return abs(float(given) - float(value)) <= 1e-12 * max(1.0, abs(float(value)))
    return given == value


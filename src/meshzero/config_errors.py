"""Turning config problems into one readable error: dotted keys, values given, what is valid.

Also the table of DeepSpeed keys that meshzero knows but does not implement yet.
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A config meshzero cannot run; the message lists every problem, one per line."""


class _Invalid(ValueError):
    """A validator's complaint worded to follow "<key> = <value> ", e.g. "is not supported"."""


# DeepSpeed keys meshzero recognises but does not implement yet: dotted key -> short note.
# Remove an entry (and add the field to its model) when the feature lands.
UNSUPPORTED_KEYS: dict[str, str] = {
    "activation_checkpointing": "use torch.utils.checkpoint in the model instead",
    "tensorboard": "monitoring backend",
    "wandb": "monitoring backend",
    "csv_monitor": "monitoring backend",
    "comms_logger": "meshzero counts communication itself",
    "amp": "NVIDIA apex AMP",
    "pipeline": "DeepSpeed's PipelineModule config; use meshzero's pipeline_parallel",
    "checkpoint": "checkpoint engine options",
    "data_types": "gradient accumulation dtype",
    "elasticity": "elastic training",
    "autotuning": "autotuner",
    "compression_training": "compression library",
    "sparse_attention": "sparse attention kernels",
    "zero_allow_untested_optimizer": "client optimizers",
    "zero_force_ds_cpu_optimizer": "CPU offload",
    "gradient_predivide_factor": "gradient pre-division",
    "prescale_gradients": "gradient pre-scaling",
    "dump_state": "state dump",
    "data_efficiency": "data efficiency library",
    "curriculum_learning": "curriculum learning",
    "torch_autocast": "torch.autocast integration",
    "sparse_gradients": "sparse gradients",
    "memory_breakdown": "use engine.memory_report()",
    "dataloader_drop_last": "DeepSpeed data loader",
    "aio": "DeepSpeed's async I/O tuning; meshzero's NVMe tier uses os.pread/pwrite threads",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "hybrid_engine": "RLHF hybrid engine",
    "compile": "torch.compile integration",
    "zero_optimization.cpu_offload": "CPU offload (spell it offload_optimizer.device 'cpu')",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload",
    "zero_optimization.offload_optimizer.pipeline": "meshzero always overlaps NVMe I/O",
    "zero_optimization.offload_optimizer.pipeline_read": "meshzero always overlaps NVMe I/O",
    "zero_optimization.offload_optimizer.pipeline_write": "meshzero always overlaps NVMe I/O",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ quantized frozen weights",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS",
    "zero_optimization.round_robin_gradients": "round-robin gradients",
    "zero_optimization.elastic_checkpoint": "elastic checkpoints",
    "zero_optimization.load_from_fp32_weights": "checkpoint loading option",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "16-bit model save",
    "zero_optimization.gather_16bit_weights_on_model_save": "16-bit model save",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always handled",
    "zero_optimization.legacy_stage1": "legacy stage 1",
    "zero_optimization.memory_efficient_linear": "memory-efficient linear",
    "zero_optimization.use_multi_rank_bucket_allreduce": "multi-rank bucket all-reduce",
    "zero_optimization.zeropp_loco_param": "ZeRO++ LoCo",
    "zero_optimization.log_trace_cache_warnings": "trace cache warnings",
    "fp16.auto_cast": "fp16 autocast of inputs",
    "fp16.consecutive_hysteresis": "consecutive hysteresis",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights",
    "scheduler.params.last_batch_iteration": "resume through the checkpoint instead",
}


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


def find_auto(node: Any, key: str) -> list[str]:
    """Dotted keys of every "auto" value at any depth."""
    if isinstance(node, str):
        return [key] if node.strip().lower() == "auto" else []
    if isinstance(node, dict):
        return [k for name, v in node.items() for k in find_auto(v, _join_key(key, name))]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in find_auto(v, f"{key}[{i}]")]
    return []


def auto_message(key: str) -> str:
    return (
        f"config key '{key}' is 'auto': meshzero does not infer values; replace it with a "
        "number (Hugging Face's Trainer resolves 'auto' before handing the config over)"
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
    if isinstance(cause, _Invalid):
        return f"{key} = {_show(error['input'])} {cause}"
    return f"{key} = {_show(error['input'])}: {cause if cause is not None else error['msg']}"


def _unknown_key_message(loc: tuple[Any, ...], raw: dict[str, Any],
                         root: type[BaseModel]) -> str:
    key = _dotted(loc)
    if key in UNSUPPORTED_KEYS:
        return (
            f"config key '{key}' is a DeepSpeed feature meshzero does not implement yet "
            f"({UNSUPPORTED_KEYS[key]}); remove it"
        )
    valid = _valid_keys(loc[:-1], raw, root)
    prefix = _dotted(loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
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

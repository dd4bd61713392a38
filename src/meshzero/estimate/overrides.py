"""Estimator flags as overrides of ds_config keys, validated by the config itself.

A flag (``stage=2``, ``--offload-optimizer cpu``, ``--tp 2``) names a config key; it is written
into the config and the whole config is validated again by :func:`meshzero.config.load_config`,
so a flag is refused exactly as the same key in a ds_config is, with the same message. Only
``seq_len``, ``activation_checkpointing`` and ``trainable`` are the estimator's own: no config
key says them.
"""

from __future__ import annotations

from typing import Any

from meshzero.config import Config, load_config
from meshzero.config.batch import resolve_batch

# estimator name -> dotted config key: the one place a flag is spelt as a config key
CONFIG_KEYS: dict[str, str] = {
    "stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "offload_param": "zero_optimization.offload_param.device",
    "optimizer_buffer_count": "zero_optimization.offload_optimizer.buffer_count",
    "param_buffer_count": "zero_optimization.offload_param.buffer_count",
    "sub_group_size": "zero_optimization.sub_group_size",
    "communication_dtype": "communication_data_type",
    "grad_dtype": "data_types.grad_accum_dtype",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "unit_classes": "zero_optimization.unit_classes",
    "tp": "tensor_parallel.size",
    "tp_plan": "tensor_parallel.plan",
    "sequence_parallel": "tensor_parallel.sequence_parallel",
    "sp": "sequence_parallel_size",
    "pp": "pipeline_parallel.size",
    "pp_schedule": "pipeline_parallel.schedule",
    "pp_layers": "pipeline_parallel.layers",
    "pp_first": "pipeline_parallel.first",
    "pp_last": "pipeline_parallel.last",
    "pp_stages_per_rank": "pipeline_parallel.stages_per_rank",
    "pp_boundaries": "pipeline_parallel.boundaries",
}
# the batch, spelt per rank: micro_batch, and grad_accum (= pp_micro_batches with a pipeline)
BATCH_KEYS = ("micro_batch", "grad_accum", "pp_micro_batches")
OWN_KEYS = ("seq_len", "activation_checkpointing", "trainable")
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}  # compute dtype -> bytes per element
# An estimate never writes files, so an NVMe tier chosen by a flag needs no real directory;
# a ds_config that names the nvme device must still give nvme_path (as initialize requires).
NVME_PATH_UNUSED = "(estimate: no files are written)"


def check_names(overrides: dict[str, Any]) -> None:
    known = {*CONFIG_KEYS, *BATCH_KEYS, *OWN_KEYS, "precision"}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown estimate setting(s): {sorted(unknown)}; valid: "
                         f"{', '.join(sorted(known))}")


def with_keys(config: Config, overrides: dict[str, Any]) -> Config:
    """``config`` with the flags that name config keys (and precision) written in, validated
    again. None means not given."""
    raw = config.model_dump(exclude_unset=True)
    given = {k: v for k, v in overrides.items() if v is not None}
    for name, value in given.items():
        if name in CONFIG_KEYS:
            _put(raw, CONFIG_KEYS[name], list(value) if isinstance(value, tuple) else value)
    for section in ("offload_optimizer", "offload_param"):
        if given.get(section) == "nvme":
            zero = raw.setdefault("zero_optimization", {})
            zero[section].setdefault("nvme_path", NVME_PATH_UNUSED)
    if "precision" in given:
        precision = given["precision"]
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        for dtype in ("fp16", "bf16"):
            _put(raw, f"{dtype}.enabled", precision == dtype)
    return load_config(raw) if given else config


def with_batch(config: Config, dp_size: int, overrides: dict[str, Any]) -> Config:
    """``config`` with its batch spelt per rank for ``dp_size`` ranks (micro batch and
    accumulation steps, no train_batch_size), flags applied, validated again. With a pipeline
    its micro-batches are the accumulation steps, so only the latter are kept."""
    given = {k: overrides[k] for k in BATCH_KEYS if overrides.get(k) is not None}
    if config.micro_batch_pending and "micro_batch" in given:  # "auto": the flag gives it
        micro, gas = given["micro_batch"], config.gradient_accumulation_steps or 1
    elif given:  # the flags re-spell the batch: the config's pipeline micro-batches may change
        _, micro, gas = resolve_batch(config.train_batch_size,
                                      config.train_micro_batch_size_per_gpu,
                                      config.gradient_accumulation_steps, dp_size)
    else:  # the config as it is: the engine's batch rules and messages
        _, micro, gas = config.resolve_batch(dp_size)
    raw = config.model_dump(exclude_unset=True)
    raw.pop("train_batch_size", None)
    raw["train_micro_batch_size_per_gpu"] = given.get("micro_batch", micro)
    raw["gradient_accumulation_steps"] = given.get("grad_accum",
                                                   given.get("pp_micro_batches", gas))
    if "pp_micro_batches" in given:
        _put(raw, "pipeline_parallel.micro_batches", given["pp_micro_batches"])
    load_config(raw)  # refuses micro-batches that differ from the accumulation steps
    raw.get("pipeline_parallel", {}).pop("micro_batches", None)
    return load_config(raw)


def _put(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value

"""DeepSpeed's ``deepspeed.runtime.config``: ``DeepSpeedConfig`` (the attributes real code
reads, over meshzero's ``load_config``) and ``DeepSpeedConfigError`` (meshzero's
``ConfigError``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshzero.config import Config, ConfigError, load_config
from meshzero.config.batch import data_parallel_size, resolve_batch
from meshzero.config.errors import read_json

logger = logging.getLogger(__name__)

# DeepSpeed's optimizer type names (lower case, as its config compares them)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"


class DeepSpeedConfigError(ConfigError):
    """DeepSpeed's `deepspeed.runtime.config.DeepSpeedConfigError`: meshzero's ConfigError."""


def _raw(config: Any) -> dict[str, Any]:
    """The ds_config as a dict (DeepSpeed's ``_param_dict``): a dict, a JSON path, a Config."""
    if isinstance(config, dict):
        return config
    if isinstance(config, Config):
        return config.model_dump(exclude_defaults=True)
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        raw = read_json(Path(config))
        if isinstance(raw, dict):
            return raw
    raise DeepSpeedConfigError(f"DeepSpeedConfig: expected a ds_config dict or the path of a "
                               f"JSON file, got {config!r}")


def _dp_size(config: Config, mpu: Any) -> int:
    """The data-parallel size the batch rule uses (DeepSpeed's ``world_size``): the mpu's,
    else the world's divided by the config's tp, pp and sp sizes."""
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_data_parallel_world_size())
    world = dist.get_world_size() if dist.is_initialized() else 1
    return data_parallel_size(world, config.tensor_parallel.size, config.pipeline_parallel.size,
                              config.sequence_parallel_size)


class DeepSpeedConfig:
    """DeepSpeed's `deepspeed.runtime.config.DeepSpeedConfig`: meshzero's Config, DeepSpeed's names.

    ``config``: a dict or a JSON path (a meshzero ``Config`` too). The batch sizes are
    resolved for this world (or the ``mpu``'s data-parallel size) as ``initialize`` would;
    the typed config is ``.config``; every problem raises one ``DeepSpeedConfigError``.
    """

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise DeepSpeedConfigError("DeepSpeedConfig(mesh_device=...): meshzero builds its "
                                       "mesh from the config's tensor_parallel / "
                                       "pipeline_parallel sections")
        self._param_dict = _raw(config)
        try:
            self.config: Config = load_config(self._param_dict)
            self.world_size = _dp_size(self.config, mpu)
            batch = resolve_batch(self.config.train_batch_size,
                                  self.config.train_micro_batch_size_per_gpu,
                                  self.config.gradient_accumulation_steps, self.world_size)
        except ConfigError as exc:
            raise DeepSpeedConfigError(str(exc)) from exc
        (self.train_batch_size, self.train_micro_batch_size_per_gpu,
         self.gradient_accumulation_steps) = batch
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self._set_attributes(self.config)

    def _set_attributes(self, c: Config) -> None:
        self.steps_per_print = c.steps_per_print
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.gradient_clipping = c.gradient_clipping
        self.prescale_gradients = c.prescale_gradients
        self.gradient_predivide_factor = c.gradient_predivide_factor
        self.communication_data_type = c.communication_data_type
        self.seq_parallel_communication_data_type = c.seq_parallel_communication_data_type
        self.zero_config = c.zero_optimization
        self.zero_optimization_stage = c.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.mics_shard_size = c.zero_optimization.mics_shard_size
        self.float16_config, self.bfloat16_config = c.fp16, c.bf16
        self.fp16_enabled, self.bfloat16_enabled = c.fp16.enabled, c.bf16.enabled
        self.torch_autocast_enabled = c.torch_autocast.enabled
        self.flops_profiler_config = c.flops_profiler
        self.comms_config = c.comms_logger
        self.optimizer_name = c.optimizer.type.lower() if c.optimizer else None
        self.optimizer_params = dict(self._param_dict.get("optimizer", {}).get("params", {}))
        self.scheduler_name = c.scheduler.type if c.scheduler else None
        self.scheduler_params = dict(self._param_dict.get("scheduler", {}).get("params", {}))
        self.sequence_parallel_size = c.sequence_parallel_size
        self.zero_allow_untested_optimizer = bool(
            self._param_dict.get("zero_allow_untested_optimizer", False))

    def print(self, name: str) -> None:
        """DeepSpeed's `DeepSpeedConfig.print`: the config's values, logged at INFO."""
        logger.info("%s:", name)
        for key, value in sorted(vars(self).items()):
            if not key.startswith("_"):
                logger.info("  %s %s", key.ljust(40, "."), value)

"""What an estimate is asked about: the cluster, and the training settings that decide memory.

The settings are a read-only view of a validated :class:`~meshzero.config.Config`: every
default and every rule is the config's. Flags (``stage=2``, ``--offload-optimizer cpu``) are
overrides of config keys validated again by the same :func:`meshzero.config.load_config`
(estimate/overrides.py), so an estimate refuses exactly what ``initialize`` refuses, with the
same message. The batch is held per rank: micro batch and accumulation steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, get_args

from meshzero.checkpoint.model_files import parse_size
from meshzero.config import Config, load_config
from meshzero.config.offload import OffloadDevice
from meshzero.estimate.overrides import (
    CONFIG_KEYS,
    OWN_KEYS,
    PRECISIONS,
    check_names,
    with_batch,
    with_keys,
)
from meshzero.zero.offload.stepping import chunk_numel

OFFLOAD_DEVICES: tuple[str, ...] = get_args(OffloadDevice)
TIER_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}
ASSUMED_OPTIMIZER = "AdamW"  # no optimizer block: the client's optimizer, assumed AdamW
# which parameters train: as their requires_grad is at initialize, every one (a group
# frozen at initialize and unfrozen later: its own layout and padding, now trainable), or
# none (an engine built without an optimizer: forward only, parameters and nothing else)
TRAINABLE = ("initialize", "all", "none")


@dataclass(frozen=True, init=False)
class Cluster:
    """``nodes`` x ``gpus_per_node`` data-parallel ranks; memory sizes in bytes (or "80GB")."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int  # bytes: a size string is parsed on construction
    host_memory: int

    def __init__(self, nodes: int = 1, gpus_per_node: int = 8,
                 gpu_memory: int | str = "80GB", host_memory: int | str = "1TB") -> None:
        for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster: {name} must be a positive integer, got {value!r} "
                                 "(a cluster needs at least one node with one GPU)")
            object.__setattr__(self, name, value)
        for name, size in (("gpu_memory", gpu_memory), ("host_memory", host_memory)):
            try:
                object.__setattr__(self, name, parse_size(size))
            except ValueError as exc:
                raise ValueError(f"cluster: {name}: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Settings:
    """A validated config seen as the numbers an estimate needs. Build it with
    :func:`settings_from_config`; ``config`` holds its batch per rank (no train_batch_size)."""

    config: Config = field(default_factory=Config, hash=False)
    seq_len: int | None = None
    activation_checkpointing: bool = False
    trainable: str = "initialize"

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {list(TRAINABLE)}, got "
                             f"{self.trainable!r} ('initialize': requires_grad as it is at "
                             "initialize; 'all': every parameter, frozen ones unfrozen later; "
                             "'none': no optimizer, forward only)")
        if self.config.train_batch_size is not None:
            raise ValueError("Settings needs the batch per rank (micro batch and accumulation "
                             "steps, no train_batch_size): build it with settings_from_config")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(
                self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len must be a positive integer, got {self.seq_len!r}")

    def replace(self, **overrides: Any) -> Settings:
        """These settings with ``overrides`` (names as :func:`settings_from_config`)."""
        check_names(overrides)
        own: dict[str, Any] = {k: overrides.get(k) for k in OWN_KEYS}
        own = {k: getattr(self, k) if v is None else v for k, v in own.items()}
        config = with_keys(self.config, overrides)
        # the batch is per rank already, so any data-parallel size resolves it the same way
        return Settings(with_batch(config, 1, overrides), **own)

    # -- the config, by the estimator's names -------------------------------------------------
    @property
    def stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def precision(self) -> str:
        """The compute dtype: fp32, bf16 or fp16 (the master: ``master_bytes``)."""
        fp16, bf16 = self.config.fp16.enabled, self.config.bf16.enabled
        return "fp16" if fp16 else "bf16" if bf16 else "fp32"

    @property
    def optimizer(self) -> str:
        """Adam (either mode), AdamW, SGD or Lamb (Adam's state bytes)."""
        if self.forward_only:
            return "none"
        opt = self.config.optimizer
        return ASSUMED_OPTIMIZER if opt is None else opt.type

    @property
    def forward_only(self) -> bool:
        """An engine without an optimizer (``trainable="none"``): parameters only."""
        return self.trainable == "none"

    @property
    def optimizer_assumed(self) -> bool:
        return self.config.optimizer is None and not self.forward_only

    @property
    def _optimizer_params(self) -> dict[str, Any]:
        opt = self.config.optimizer
        return {} if opt is None else opt.params  # complete: the config filled the defaults

    @property
    def amsgrad(self) -> bool:
        return bool(self._optimizer_params.get("amsgrad", False))

    @property
    def momentum(self) -> float:
        return float(self._optimizer_params.get("momentum", 0.0))

    @property
    def micro_batch(self) -> int:
        return self.config.resolve_batch(1)[1]

    @property
    def grad_accum(self) -> int:
        """Accumulation steps: with a pipeline, also the micro-batches of one step."""
        return self.config.resolve_batch(1)[2]

    @property
    def offload_optimizer(self) -> str:
        """offload_optimizer.device; "none" without an optimizer (nothing to offload)."""
        if self.forward_only:
            return "none"
        return self.config.zero_optimization.offload_optimizer.device

    @property
    def offload_param(self) -> str:
        return self.config.zero_optimization.offload_param.device

    @property
    def optimizer_buffer_count(self) -> int:
        return self.config.zero_optimization.offload_optimizer.buffer_count

    @property
    def param_buffer_count(self) -> int:
        return self.config.zero_optimization.offload_param.buffer_count

    @property
    def sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    @property
    def communication_dtype(self) -> str | None:
        return self.config.communication_data_type

    @property
    def grad_dtype(self) -> str:
        """The gradient dtype: data_types.grad_accum_dtype, else the compute dtype."""
        return self.config.data_types.grad_accum_dtype or self.precision

    @property
    def reduce_dtype(self) -> str:
        """What gradients are reduced in: communication_data_type, else the gradient dtype."""
        return self.communication_dtype or self.grad_dtype

    @property
    def reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    @property
    def allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    @property
    def prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.stage3_prefetch_bucket_size

    @property
    def persistence_threshold(self) -> int:
        return self.config.zero_optimization.stage3_param_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        return self.config.zero_optimization.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.config.zero_optimization.stage3_max_reuse_distance

    @property
    def unit_classes(self) -> tuple[str, ...] | None:
        classes = self.config.zero_optimization.unit_classes
        return None if classes is None else tuple(classes)

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel.size

    @property
    def tp_plan(self) -> str | dict[str, str] | None:
        """A shipped plan's name or {pattern: style}."""
        return self.config.tensor_parallel.plan

    @property
    def sequence_parallel(self) -> bool:
        return self.config.tensor_parallel.sequence_parallel

    @property
    def sp(self) -> int:
        """Ulysses sequence-parallel size: each rank holds seq_len / sp of every sample."""
        return self.config.sequence_parallel_size

    @property
    def pp(self) -> int:
        return self.config.pipeline_parallel.size

    @property
    def pp_schedule(self) -> str:
        return self.config.pipeline_parallel.schedule

    @property
    def pp_layers(self) -> str:
        return self.config.pipeline_parallel.layers

    @property
    def pp_first(self) -> tuple[str, ...]:
        return tuple(self.config.pipeline_parallel.first)

    @property
    def pp_last(self) -> tuple[str, ...]:
        return tuple(self.config.pipeline_parallel.last)

    @property
    def pp_stages_per_rank(self) -> int | None:
        return self.config.pipeline_parallel.stages_per_rank

    @property
    def pp_boundaries(self) -> tuple[int, ...] | None:
        bounds = self.config.pipeline_parallel.boundaries
        return None if bounds is None else tuple(bounds)

    # -- derived ------------------------------------------------------------------------------
    @property
    def compute_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def comm_bytes(self) -> int:
        """Bytes per element gradients are reduced in (the reduce dtype)."""
        return PRECISIONS[self.reduce_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradient buffers (the gradient dtype)."""
        return PRECISIONS[self.grad_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes per element of the master: 2 with bf16.bf16_master_weights_and_grads."""
        return 2 if self.config.bf16.bf16_master_weights_and_grads else 4

    @property
    def split_numel(self) -> int | None:
        """In-memory gradient shards not in the master's dtype: the longest optimizer leaf
        (the tier's ``split_numel()``); None: leaves are whole fragments."""
        if self.grad_bytes == self.master_bytes or self.offload_optimizer == "nvme":
            return None
        return chunk_numel(self.sub_group_size)

    @property
    def state_bytes_per_element(self) -> int:
        """Optimizer-state bytes per owned element: Adam's (and LAMB's) m, v (+ max v with
        amsgrad), fp32 or with bf16.bf16_optimizer_states bf16; SGD's momentum."""
        if self.optimizer == "SGD":
            return 4 if self.momentum > 0 else 0
        state_bytes = 2 if self.config.bf16.bf16_optimizer_states else 4
        return state_bytes * (3 if self.amsgrad else 2)

    @property
    def state_bytes_per_fragment(self) -> int:
        """Adam keeps a 4-byte fp32 ``step`` tensor per parameter fragment; SGD keeps none."""
        return 0 if self.optimizer == "SGD" else 4

    @property
    def optimizer_tier(self) -> str:
        return TIER_OF[self.offload_optimizer]

    @property
    def param_tier(self) -> str:
        return TIER_OF[self.offload_param]

    def trains(self, group: Any) -> bool:
        """Whether a flat group (zero/units.GroupLayout) holds a master, gradients and
        optimizer state: trainable at initialize, or any group with ``trainable="all"``
        (the engine makes a frozen group trainable, with its own padding, when one of its
        parameters is unfrozen: zero/trainability.py)."""
        if self.forward_only:
            return False
        return bool(group.requires_grad) or self.trainable == "all"

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    def dp_size(self, world_size: int) -> int:
        """Data-parallel ranks of ``world_size``: world / (tp * pp * sp)."""
        return self.config.dp_size(world_size)

    def zero_size(self, world_size: int) -> int:
        """The ranks ZeRO shards over: dp x sp."""
        return self.dp_size(world_size) * self.sp

    def to_dict(self) -> dict[str, Any]:
        """The settings by the estimator's names (the "settings" of an estimate's JSON)."""
        names = ("stage", "precision", "optimizer", "amsgrad", "momentum", "optimizer_assumed",
                 "micro_batch", "grad_accum", *OWN_KEYS, *CONFIG_KEYS)
        return {name: getattr(self, name) for name in dict.fromkeys(names)}

    def describe_mesh(self) -> str:
        parts = []
        if self.tp > 1:
            plan = self.tp_plan if isinstance(self.tp_plan, str) else "custom"
            parts.append(f"tp {self.tp} (plan {plan}"
                         + (", sequence parallel)" if self.sequence_parallel else ")"))
        if self.pp > 1:
            parts.append(f"pp {self.pp} ({self.pp_schedule}, {self.grad_accum} micro-batches)")
        if self.sp > 1:
            parts.append(f"sp {self.sp} (Ulysses: seq len / {self.sp} per rank, ZeRO over "
                         "dp x sp)")
        return ", ".join(parts)

    def describe(self) -> str:
        mesh = self.describe_mesh()
        opt = self.optimizer + (" (assumed: the config has no optimizer block)"
                                if self.optimizer_assumed else "")
        if self.forward_only:
            opt = "no optimizer (forward only: parameters, no master, gradients or states)"
        grads = "" if self.grad_dtype == self.precision else f" with {self.grad_dtype} gradients"
        return (f"ZeRO stage {self.stage}, {self.precision}{grads}, {opt}, offload optimizer "
                f"{self.offload_optimizer} / params {self.offload_param}, micro batch "
                f"{self.micro_batch}, grad accumulation {self.grad_accum}, seq len "
                f"{self.seq_len if self.seq_len is not None else 'n/a'}, activation "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}"
                + (", every parameter trainable (frozen ones unfrozen after initialize)"
                   if self.trainable == "all" else "")
                + (f", {mesh}" if mesh else ""))


def settings_from_config(config: Config | dict[str, Any] | str | os.PathLike[str] | None,
                         world_size: int, **overrides: Any) -> Settings:
    """Settings of a ds_config for ``world_size`` ranks; ``overrides`` (flags, by the names of
    :class:`Settings`' properties, plus precision) win when not None. The config is refused
    as ``initialize`` refuses it; with no config, the schema's defaults (stage 0, fp32, AdamW
    assumed)."""
    check_names(overrides)
    cfg = load_config(config if config is not None else {})  # initialize's own checks
    cfg = with_keys(cfg, overrides)
    cfg = with_batch(cfg, cfg.dp_size(world_size), overrides)
    return Settings(cfg, **{k: overrides[k] for k in OWN_KEYS if overrides.get(k) is not None})

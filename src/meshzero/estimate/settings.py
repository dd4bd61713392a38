"""What an estimate is asked about: the cluster, and the training settings that decide memory.

Settings come from a ds_config (validated by :func:`meshzero.config.load_config`) and/or flags;
a flag given explicitly overrides the config. Everything here is plain data with checks that
raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from meshzero.checkpoint.model_files import parse_size
from meshzero.config import Config, load_config

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
TIER_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` data-parallel ranks; memory sizes in bytes (or "80GB")."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory: int | str = "80GB"
    host_memory: int | str = "1TB"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster: {name} must be a positive integer, got {value!r} "
                                 "(a cluster needs at least one node with one GPU)")
        for name in ("gpu_memory", "host_memory"):
            try:
                object.__setattr__(self, name, parse_size(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"cluster: {name}: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Settings:
    """The training settings that decide memory and time, with DeepSpeed's defaults."""

    stage: int = 0
    precision: str = "fp32"  # compute dtype: fp32, bf16 or fp16 (the master is always fp32)
    optimizer: str = "AdamW"  # Adam, AdamW or SGD
    amsgrad: bool = False
    momentum: float = 0.0  # SGD
    optimizer_assumed: bool = False  # no optimizer block: AdamW assumed
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int | None = None
    activation_checkpointing: bool = False
    offload_optimizer: str = "none"
    offload_param: str = "none"
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    sub_group_size: int = 1_000_000_000
    communication_dtype: str | None = None
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    unit_classes: tuple[str, ...] | None = field(default=None)
    # the mesh (dp = world / (tp * pp)); see estimate/mesh.py
    tp: int = 1
    tp_plan: Any = field(default=None, hash=False)  # a shipped plan's name or {pattern: style}
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_micro_batches: int | None = None  # None: grad_accum (the engine requires them equal)
    pp_layers: str = ""
    pp_first: tuple[str, ...] = ()
    pp_last: tuple[str, ...] = ()
    pp_stages_per_rank: int | None = None
    pp_boundaries: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = self._mesh_problems()
        if self.stage not in (0, 1, 2, 3):
            problems.append(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for name in ("micro_batch", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            problems.append(f"seq_len must be a positive integer, got {self.seq_len!r}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                problems.append(f"{name} must be one of {list(OFFLOAD_DEVICES)}, "
                                f"got {getattr(self, name)!r}")
        if self.offload_optimizer != "none" and self.stage == 0:
            problems.append(f"offload_optimizer {self.offload_optimizer!r} needs stage 1, 2 or 3 "
                            "(stage is 0)")
        if self.offload_param != "none" and self.stage != 3:
            problems.append(f"offload_param {self.offload_param!r} needs stage 3 "
                            f"(stage is {self.stage})")
        if self.offload_param == "nvme" and self.offload_optimizer != "nvme":
            problems.append("offload_param 'nvme' needs offload_optimizer 'nvme' (it is "
                            f"{self.offload_optimizer!r})")
        if problems:
            raise ValueError("; ".join(problems))

    def _mesh_problems(self) -> list[str]:
        problems = []
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.tp != 1 and self.tp_plan is None:
            problems.append(f"tensor parallel size {self.tp} needs a plan (tensor_parallel.plan "
                            "or --tp-plan: gpt, hf_gpt2, llama or a {pattern: style} mapping)")
        if self.pp != 1:
            from meshzero.parallel.pipeline import SCHEDULES

            if self.pp_schedule not in SCHEDULES:
                problems.append(f"unknown pipeline schedule {self.pp_schedule!r}; valid: "
                                f"{', '.join(SCHEDULES)}")
            if self.stage == 3:
                problems.append(f"pipeline parallel size {self.pp} with ZeRO stage 3: the "
                                "engine supports stages 0-2 with a pipeline")
            if self.sequence_parallel:
                problems.append("sequence_parallel with pipeline parallelism is not supported "
                                "by the engine")
        return problems

    # -- derived ------------------------------------------------------------------------------
    @property
    def compute_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def comm_bytes(self) -> int:
        """Bytes per element gradients are reduced in (fp32 unless communication_data_type)."""
        return 4 if self.communication_dtype is None else PRECISIONS[self.communication_dtype]

    @property
    def state_bytes_per_element(self) -> int:
        """fp32 optimizer-state bytes per owned element: Adam m, v (+ max v with amsgrad)."""
        if self.optimizer == "SGD":
            return 4 if self.momentum > 0 else 0
        return 4 * (3 if self.amsgrad else 2)

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

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches of one pipeline step (= the gradient accumulation steps)."""
        return self.pp_micro_batches or self.grad_accum

    def dp_size(self, world_size: int) -> int:
        """Data-parallel (ZeRO) ranks of ``world_size``: world / (tp * pp)."""
        if world_size % self.model_parallel:
            raise ValueError(f"the world size {world_size} is not divisible by tensor parallel "
                             f"{self.tp} x pipeline parallel {self.pp}")
        return world_size // self.model_parallel

    def describe_mesh(self) -> str:
        parts = []
        if self.tp > 1:
            plan = self.tp_plan if isinstance(self.tp_plan, str) else "custom"
            parts.append(f"tp {self.tp} (plan {plan}"
                         + (", sequence parallel)" if self.sequence_parallel else ")"))
        if self.pp > 1:
            parts.append(f"pp {self.pp} ({self.pp_schedule}, {self.micro_batches} micro-batches)")
        return ", ".join(parts)

    def describe(self) -> str:
        mesh = self.describe_mesh()
        opt = self.optimizer + (" (assumed: the config has no optimizer block)"
                                if self.optimizer_assumed else "")
        return (f"ZeRO stage {self.stage}, {self.precision}, {opt}, offload optimizer "
                f"{self.offload_optimizer} / params {self.offload_param}, micro batch "
                f"{self.micro_batch}, grad accumulation {self.grad_accum}, seq len "
                f"{self.seq_len if self.seq_len is not None else 'n/a'}, activation "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}"
                + (f", {mesh}" if mesh else ""))


def settings_from_config(config: Config | dict[str, Any] | str | os.PathLike[str] | None,
                         world_size: int, **overrides: Any) -> Settings:
    """Settings of a ds_config for ``world_size`` ranks; ``overrides`` (flags) win when not
    None. With no config, DeepSpeed's defaults (stage 0, fp32, AdamW assumed)."""
    cfg = load_config(config if config is not None else {})  # no config: the schema defaults
    tp = overrides.get("tp") or cfg.tensor_parallel.size
    pp = overrides.get("pp") or cfg.pipeline_parallel.size
    if world_size % (tp * pp):
        raise ValueError(f"the world size {world_size} is not divisible by tensor parallel "
                         f"{tp} x pipeline parallel {pp}")
    values = _from_config(cfg, world_size // (tp * pp))
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values.get("pp", 1) > 1 and values.get("pp_micro_batches"):
        m = values["pp_micro_batches"]
        if values.get("grad_accum", m) != m:
            raise ValueError(f"pipeline micro_batches ({m}) != the gradient accumulation steps "
                             f"({values['grad_accum']}): the engine requires them equal")
        values["grad_accum"] = m
    for key in ("unit_classes", "pp_first", "pp_last", "pp_boundaries"):
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    unknown = set(values) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise ValueError(f"unknown estimate setting(s): {sorted(unknown)}")
    return Settings(**values)


def _from_config(cfg: Config, dp_size: int) -> dict[str, Any]:
    tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
    zc = cfg.zero_optimization
    values: dict[str, Any] = {
        "stage": zc.stage,
        "precision": "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32",
        "communication_dtype": cfg.communication_data_type,
        "reduce_bucket_size": zc.reduce_bucket_size,
        "allgather_bucket_size": zc.allgather_bucket_size,
        "prefetch_bucket_size": zc.stage3_prefetch_bucket_size,
        "persistence_threshold": zc.stage3_param_persistence_threshold,
        "max_live_parameters": zc.stage3_max_live_parameters,
        "max_reuse_distance": zc.stage3_max_reuse_distance,
        "unit_classes": zc.unit_classes,
        "tp": tp.size, "tp_plan": tp.plan, "sequence_parallel": tp.sequence_parallel,
        "pp": pp.size, "pp_schedule": pp.schedule, "pp_micro_batches": pp.micro_batches,
        "pp_layers": pp.layers, "pp_first": tuple(pp.first), "pp_last": tuple(pp.last),
        "pp_stages_per_rank": pp.stages_per_rank,
        "pp_boundaries": tuple(pp.boundaries) if pp.boundaries is not None else None,
    }
    for key, prefix in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
        section = getattr(zc, key)
        values[key] = section.device
        values[f"{prefix}_buffer_count"] = section.buffer_count
    values["sub_group_size"] = zc.sub_group_size
    if cfg.optimizer is None:
        values["optimizer_assumed"] = True
    else:
        params = cfg.optimizer.validated_params()
        values["optimizer"] = cfg.optimizer.type  # Adam (either mode), AdamW or SGD
        values["amsgrad"] = bool(params.get("amsgrad", False))
        values["momentum"] = float(params.get("momentum", 0.0))
    if any(x is not None for x in (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu)):
        _, values["micro_batch"], values["grad_accum"] = cfg.resolve_batch(dp_size)
    return values

"""DeepSpeed's ds_config.json schema as typed, strict pydantic models.

`load_config` is the entry point: it accepts a dict, a path to a JSON file or an existing
`Config`, and turns every problem it finds into one `ConfigError` that lists each problem on its
own line with the dotted key, the value given and what is valid. Nothing is silently ignored:
unknown keys fail with the nearest valid key, DeepSpeed keys meshzero does not implement yet fail
saying so, and "auto" values fail with how to resolve them.
"""

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from meshzero.config_errors import (
    ConfigError,
    _Invalid,
    auto_message,
    describe,
    find_auto,
    read_json,
    report,
)
from meshzero.config_mesh import (
    OffloadOptimizerConfig,
    OffloadParamConfig,
    PipelineParallelConfig,
    TensorParallelConfig,
    TopologyConfig,
)
from meshzero.config_types import (
    Beta,
    Bool,
    Float,
    Int,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Ratio,
    WarmupType,
    _Model,
)

# --- optimizer and scheduler ---------------------------------------------------------------


class AdamParams(_Model):
    """DeepSpeed's "Adam": decoupled weight decay (i.e. AdamW) unless adam_w_mode is false.

    With adam_w_mode false, weight_decay is added to the gradient (L2 regularisation, the
    behaviour of torch.optim.Adam).
    """

    lr: PosFloat = 1e-3
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    adam_w_mode: Bool = True


class AdamWParams(_Model):
    """DeepSpeed's "AdamW": Adam with decoupled weight decay (torch.optim.AdamW)."""

    lr: PosFloat = 1e-3
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.01
    amsgrad: Bool = False


class SGDParams(_Model):
    """torch.optim.SGD's arguments; lr has no default, as in torch."""

    lr: PosFloat
    momentum: NonNegFloat = 0.0
    dampening: Float = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: Bool = False

    @field_validator("nesterov")
    @classmethod
    def _nesterov_needs_momentum(cls, nesterov: bool, info: ValidationInfo) -> bool:
        if nesterov and (info.data.get("momentum", 1.0) <= 0 or info.data.get("dampening")):
            raise _Invalid("needs momentum > 0 and dampening = 0")
        return nesterov


OPTIMIZER_PARAMS: dict[str, type[_Model]] = {
    "Adam": AdamParams,
    "AdamW": AdamWParams,
    "SGD": SGDParams,
}
DEEPSPEED_ONLY_OPTIMIZERS = (
    "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lion", "Adagrad", "MuAdam", "MuAdamW",
    "MuSGD", "FusedAdam", "FusedLamb", "FusedLion", "CPUAdam", "CPUAdagrad", "CPULion", "Adafactor",
)  # fmt: skip


def _after_warmup(total: int, info: ValidationInfo) -> int:
    warmup = info.data.get("warmup_num_steps", 0)
    if total <= warmup:
        raise _Invalid(f"must be greater than warmup_num_steps ({warmup})")
    return total


class WarmupLRParams(_Model):
    warmup_min_lr: NonNegFloat = 0.0
    warmup_max_lr: NonNegFloat = 0.001
    warmup_num_steps: NonNegInt = 1000
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: PosInt  # declared after warmup_num_steps so its validator can compare

    _total = field_validator("total_num_steps")(_after_warmup)


class WarmupCosineLRParams(_Model):
    warmup_num_steps: NonNegInt = 1000
    total_num_steps: PosInt
    warmup_min_ratio: Ratio = 0.0
    cos_min_ratio: Ratio = 0.0001
    warmup_type: WarmupType = "log"

    _total = field_validator("total_num_steps")(_after_warmup)


SCHEDULER_PARAMS: dict[str, type[_Model]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
DEEPSPEED_ONLY_SCHEDULERS = ("OneCycle", "LRRangeTest")


class _TypedSection(_Model):
    """A `type`, matched case-insensitively and kept in its canonical spelling, and `params`,
    checked against that type's own model (so a misspelt param is an unknown key) and stored
    complete: every param of the type, defaults filled, ints as ints."""

    kinds: ClassVar[dict[str, type[_Model]]]
    deepspeed_only: ClassVar[tuple[str, ...]]
    what: ClassVar[str]

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def params_model(cls, kind: Any) -> type[_Model] | None:
        """The params model for `kind` in any case, or None if it is not a known type."""
        lower = str(kind).lower()
        return next((model for name, model in cls.kinds.items() if name.lower() == lower), None)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value  # the str field reports the wrong type
        for name in cls.kinds:
            if name.lower() == value.lower():
                return name
        valid = ", ".join(cls.kinds)
        if value.lower() in {name.lower() for name in cls.deepspeed_only}:
            raise _Invalid(f"is a DeepSpeed {cls.what} meshzero does not implement; valid: {valid}")
        raise _Invalid(f"is not a {cls.what} meshzero knows; valid: {valid}")

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:  # a bad type was reported already; params cannot be checked
            return params
        return cls.kinds[info.data["type"]].model_validate(params).model_dump()

    def validated_params(self) -> dict[str, Any]:
        """All params of this type, defaults filled in."""
        return self.kinds[self.type].model_validate(self.params).model_dump()


class OptimizerConfig(_TypedSection):
    """`optimizer`: type Adam, AdamW or SGD (any case) and its params."""

    kinds = OPTIMIZER_PARAMS
    deepspeed_only = DEEPSPEED_ONLY_OPTIMIZERS
    what = "optimizer"


class SchedulerConfig(_TypedSection):
    """`scheduler`: type WarmupLR, WarmupDecayLR or WarmupCosineLR (any case) and its params."""

    kinds = SCHEDULER_PARAMS
    deepspeed_only = DEEPSPEED_ONLY_SCHEDULERS
    what = "scheduler"


# --- precision and ZeRO --------------------------------------------------------------------


class FP16Config(_Model):
    """`fp16`: loss_scale 0 means dynamic scaling starting at 2**initial_scale_power."""

    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: Annotated[Int, Field(ge=0, le=64)] = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    min_loss_scale: PosFloat = 1.0


class BF16Config(_Model):
    enabled: Bool = False


_ALWAYS_ON = {
    "contiguous_gradients": "meshzero always keeps gradients in contiguous flat buffers",
    "reduce_scatter": "meshzero always reduces gradients with reduce-scatter",
    "allgather_partitions": "meshzero always all-gathers whole partitions",
}


class ZeroConfig(_Model):
    """`zero_optimization`; unit_classes (meshzero's own key) names the module classes whose
    instances become ZeRO units (gathered and released together)."""

    stage: Annotated[Int, Field(ge=0, le=3)] = 0
    overlap_comm: Bool = True
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    allgather_partitions: Bool = True
    reduce_bucket_size: PosInt = 500_000_000
    allgather_bucket_size: PosInt = 500_000_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_max_live_parameters: PosInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    unit_classes: list[Annotated[str, Strict(), Field(min_length=1)]] | None = None
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    sub_group_size: PosInt = 1_000_000_000
    zero_hpz_partition_size: PosInt = 1
    mics_shard_size: Annotated[Int, Field(ge=-1)] = -1

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> "ZeroConfig":
        problems = []
        opt, par = self.offload_optimizer.device, self.offload_param.device
        if opt != "none" and self.stage == 0:
            problems.append(f"zero_optimization.offload_optimizer.device = {opt!r} needs "
                            "zero_optimization.stage 1, 2 or 3 (stage is 0)")
        if par != "none" and self.stage != 3:
            problems.append(f"zero_optimization.offload_param.device = {par!r} needs "
                            f"zero_optimization.stage 3 (stage is {self.stage}): parameters "
                            "are sharded, and so can be offloaded, only at stage 3")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            problems.append(f"zero_optimization.zero_hpz_partition_size = "
                            f"{self.zero_hpz_partition_size} needs zero_optimization.stage 3 "
                            f"(stage is {self.stage}): it keeps a secondary parameter shard")
        if self.mics_shard_size not in (-1, 0, 1) and self.stage == 0:
            problems.append(f"zero_optimization.mics_shard_size = {self.mics_shard_size} needs "
                            "zero_optimization.stage 1, 2 or 3 (stage is 0)")
        if self.mics_shard_size > 1 and self.zero_hpz_partition_size > 1:
            problems.append("zero_optimization.mics_shard_size and zero_hpz_partition_size are "
                            "both set; choose one way of keeping traffic inside a node")
        if par == "nvme" and opt != "nvme":
            problems.append("zero_optimization.offload_param.device = 'nvme' needs "
                            f"zero_optimization.offload_optimizer.device = 'nvme' (it is "
                            f"{opt!r}): the NVMe optimizer step writes the parameter files")
        for key, section in (("offload_optimizer", self.offload_optimizer),
                             ("offload_param", self.offload_param)):
            if section.device == "nvme" and section.nvme_path is None:
                problems.append(f"zero_optimization.{key}.device = 'nvme' needs "
                                f"zero_optimization.{key}.nvme_path (a writable directory)")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @field_validator(*_ALWAYS_ON)
    @classmethod
    def _only_true(cls, value: bool, info: ValidationInfo) -> bool:
        if not value:
            raise _Invalid(f"is not supported: {_ALWAYS_ON[info.field_name]}; only true is valid")
        return value


class FlopsProfilerConfig(_Model):
    """`flops_profiler`: profile one whole optimizer step (every micro-step) at profile_step.

    meshzero measures activation-checkpoint recomputation, so recompute_fwd_factor (an
    assumed factor in DeepSpeed) must stay 0. peak_flops is meshzero's own key: the peak
    FLOP/s of one rank's device for MFU (default: a table of known GPUs, or a short matmul
    measured once on CPU)."""

    enabled: Bool = False
    profile_step: NonNegInt = 1
    module_depth: Annotated[Int, Field(ge=-1)] = -1
    top_modules: PosInt = 1
    detailed: Bool = True
    output_file: Annotated[str, Strict(), Field(min_length=1)] | None = None
    recompute_fwd_factor: NonNegFloat = 0.0
    peak_flops: PosFloat | None = None

    @field_validator("recompute_fwd_factor")
    @classmethod
    def _measured(cls, value: float) -> float:
        if value != 0.0:
            raise _Invalid("is not supported: meshzero measures recomputation (reported "
                           "separately) instead of assuming a factor; use 0")
        return value


# --- top level -----------------------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Config(BaseModel):
    """A validated ds_config. Build it with `load_config`; fields keep DeepSpeed's names."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    gradient_clipping: NonNegFloat = 0.0
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    steps_per_print: PosInt = 10
    wall_clock_breakdown: Bool = False
    seed: NonNegInt | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline_parallel: PipelineParallelConfig = Field(default_factory=PipelineParallelConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        problems = _batch_problems(self)
        if self.fp16.enabled and self.bf16.enabled:
            problems.append("fp16.enabled and bf16.enabled are both true; enable at most one")
        problems += _mesh_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def resolve_batch(self, dp_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, gradient accumulation steps) for `dp_size`
        ranks, under train_batch_size == micro * accumulation * dp_size."""
        return _resolve_batch(self, dp_size)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    @property
    def communication_dtype(self) -> torch.dtype | None:
        dtype = self.communication_data_type
        return None if dtype is None else _DTYPES[dtype]


def _mesh_problems(config: Config) -> list[str]:
    """Checks of the mesh keys against each other (the world size is checked at start)."""
    problems = []
    pp, tp, zc = config.pipeline_parallel, config.tensor_parallel, config.zero_optimization
    if pp.size > 1 and zc.stage == 3:
        problems.append(f"pipeline_parallel.size = {pp.size} with zero_optimization.stage 3: "
                        "ZeRO-3 gathers parameters per micro-batch, which pipelining defeats; "
                        "use stage 1 or 2 with pipeline parallelism")
    if pp.size > 1 and zc.offload_param.device != "none":
        problems.append("zero_optimization.offload_param needs stage 3, which pipeline "
                        "parallelism does not support")
    if pp.size > 1 and tp.sequence_parallel:
        problems.append("tensor_parallel.sequence_parallel with pipeline_parallel.size > 1 is "
                        "not supported: activations between stages would be split by sequence")
    if tp.size > 1 and zc.offload_optimizer.device == "nvme":
        problems.append("tensor_parallel.size > 1 with offload_optimizer.device 'nvme' is not "
                        "supported yet (the NVMe gradient norm does not weigh replicated "
                        "tensors); use 'cpu'")
    if tp.size > 1 and tp.plan is None:
        problems.append(f"tensor_parallel.size = {tp.size} needs tensor_parallel.plan: a shipped "
                        "plan's name (gpt, hf_gpt2, llama) or {module pattern: "
                        "colwise|rowwise|vocab}")
    gas = config.gradient_accumulation_steps
    if pp.size > 1 and pp.micro_batches is not None and gas is not None and gas != \
            pp.micro_batches:
        problems.append(f"pipeline_parallel.micro_batches ({pp.micro_batches}) != "
                        f"gradient_accumulation_steps ({gas}): with pipelining the micro-batches "
                        "of one step are the accumulation steps; give one of them")
    return problems


def _batch_problems(config: Config) -> list[str]:
    """Batch checks that hold whatever the data-parallel size is."""
    tbs, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
    gas = config.gradient_accumulation_steps
    if tbs is None and micro is None and gas is not None:
        return [
            f"gradient_accumulation_steps ({gas}) alone does not set the batch size; also give "
            "train_batch_size or train_micro_batch_size_per_gpu"
        ]
    per_rank = (micro or 1) * (gas or 1)
    if tbs is None or tbs % per_rank == 0:
        return []
    names = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    factors = " * ".join(f"{name} ({n})" for name, n in names.items() if n is not None)
    product = f" = {per_rank}" if micro and gas else ""
    return [
        f"train_batch_size ({tbs}) is not divisible by {factors}{product}, so no data-parallel "
        "size satisfies train_batch_size = train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * data-parallel size"
    ]


def _resolve_batch(config: Config, dp_size: int) -> tuple[int, int, int]:
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"data-parallel size must be a positive integer, got {dp_size!r}")
    tbs, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
    gas = config.gradient_accumulation_steps
    if tbs is None:
        if micro is None and gas is not None:
            raise ConfigError(_batch_problems(config)[0])
        micro, gas = micro or 1, gas or 1
        return micro * gas * dp_size, micro, gas
    if micro is None:
        gas = gas or 1
        micro = _divide(tbs, gas, dp_size, "gradient_accumulation_steps",
                        "train_micro_batch_size_per_gpu")  # fmt: skip
    elif gas is None:
        gas = _divide(tbs, micro, dp_size, "train_micro_batch_size_per_gpu",
                      "gradient_accumulation_steps")  # fmt: skip
    if tbs != micro * gas * dp_size:
        raise ConfigError(
            f"train_batch_size ({tbs}) != train_micro_batch_size_per_gpu ({micro}) * "
            f"gradient_accumulation_steps ({gas}) * data-parallel size ({dp_size}) = "
            f"{micro * gas * dp_size}"
        )
    return tbs, micro, gas


def _divide(tbs: int, known: int, dp_size: int, known_key: str, missing_key: str) -> int:
    """train_batch_size / (known * dp_size), which must be a whole number."""
    if tbs % (known * dp_size):
        raise ConfigError(
            f"train_batch_size ({tbs}) is not divisible by {known_key} ({known}) * data-parallel "
            f"size ({dp_size}) = {known * dp_size}, so {missing_key} would be "
            f"{tbs / (known * dp_size):g}"
        )
    return tbs // (known * dp_size)


# --- loading and error reporting -----------------------------------------------------------


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

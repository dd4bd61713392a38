"""The whole ds_config: its sections, and the rules that tie keys of different sections
together. Each default lives on its field and each rule in one place: the estimator reads a
`Config` rather than restating them."""

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from meshzero.config.batch import (
    batch_problems,
    check_pipeline_batches,
    data_parallel_size,
    resolve_batch,
)
from meshzero.config.faults import FaultsConfig
from meshzero.config.mesh import PipelineParallelConfig, TensorParallelConfig, TopologyConfig
from meshzero.config.monitor import (
    CommsLoggerConfig,
    CSVMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from meshzero.config.optimizer import OptimizerConfig, SchedulerConfig, optimizer_problems
from meshzero.config.precision import (
    BF16Config,
    DataTypesConfig,
    FP16Config,
    TorchAutocastConfig,
)
from meshzero.config.profiler import FlopsProfilerConfig
from meshzero.config.scalars import Bool, NonNegFloat, NonNegInt, PosFloat, PosInt
from meshzero.config.sequence import SeqCommDtype, sequence_problems
from meshzero.config.zero import ZeroConfig

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
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    gradient_clipping: NonNegFloat = 0.0
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    prescale_gradients: Bool = False
    gradient_predivide_factor: PosFloat = 1.0
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    steps_per_print: PosInt = 10
    wall_clock_breakdown: Bool = False
    seed: NonNegInt | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline_parallel: PipelineParallelConfig = Field(default_factory=PipelineParallelConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    sequence_parallel_size: PosInt = 1  # Ulysses (config/sequence.py)
    seq_parallel_communication_data_type: SeqCommDtype | None = None
    # what load_config accepted without it changing results: the hint keys (one INFO line
    # at initialize) and the deprecated spellings it renamed
    _hints: tuple[str, ...] = PrivateAttr(default=())
    _deprecations: tuple[str, ...] = PrivateAttr(default=())
    # each "auto" load_config resolved (one INFO line each at initialize), the keys it read
    # and ignored (one WARNING each), and, when an "auto" or AutoTP's plan depends on the
    # model and none was given, the dict to resolve again when initialize gives it (and the
    # values it gave, to tell a copy changed since)
    _auto_resolved: tuple[str, ...] = PrivateAttr(default=())
    _warnings: tuple[str, ...] = PrivateAttr(default=())
    _needs_model: tuple[dict[str, Any], dict[str, Any]] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        problems = batch_problems(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                  self.gradient_accumulation_steps)
        if self.fp16.enabled and self.bf16.enabled:
            problems.append("fp16.enabled and bf16.enabled are both true; enable at most one")
        problems += _autocast_problems(self) + _bf16_master_problems(self)
        if self.data_types.grad_accum_dtype == "fp16" and not self.fp16.enabled:
            problems.append("data_types.grad_accum_dtype = 'fp16' needs fp16.enabled: without "
                            "fp16's loss scaling and overflow check, fp16 gradients underflow "
                            "or overflow silently; use 'bf16' or 'fp32'")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            problems.append(f"prescale_gradients is true and gradient_predivide_factor is "
                            f"{self.gradient_predivide_factor}: both say where gradients are "
                            "divided; give one")
        problems += _mesh_problems(self) + sequence_problems(self)
        problems += optimizer_problems(
            self.optimizer, tp_size=self.tensor_parallel.size, pp_size=self.pipeline_parallel.size,
            offload_optimizer=self.zero_optimization.offload_optimizer.device,
            bf16_states=self.bf16.bf16_optimizer_states)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def resolve_batch(self, dp_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, gradient accumulation steps) for `dp_size`
        ranks, under train_batch_size == micro * accumulation * dp_size; with pipelining the
        accumulation steps must equal pipeline_parallel.micro_batches."""
        batch = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                              self.gradient_accumulation_steps, dp_size)
        if self.pipeline_parallel.size > 1:
            check_pipeline_batches(self.pipeline_parallel.micro_batches, *batch, dp_size)
        return batch

    def dp_size(self, world_size: int) -> int:
        """Data-parallel ranks of `world_size`: world / (tp * pp * sp) (ZeRO shards over
        dp x sp)."""
        return data_parallel_size(world_size, self.tensor_parallel.size,
                                  self.pipeline_parallel.size, self.sequence_parallel_size)

    @property
    def hints(self) -> tuple[str, ...]:
        """Accepted DeepSpeed hints that change nothing here (with why)."""
        return self._hints

    @property
    def deprecations(self) -> tuple[str, ...]:
        """Deprecated DeepSpeed spellings that load_config renamed."""
        return self._deprecations

    @property
    def auto_resolved(self) -> tuple[str, ...]:
        """Each "auto" load_config filled: the key, its value and the rule (config.auto)."""
        return self._auto_resolved

    @property
    def warnings(self) -> tuple[str, ...]:
        """Keys load_config read and ignored, or read elsewhere than written, with why."""
        return self._warnings

    def grad_predivide(self, dp_size: int) -> float:
        """What gradients are divided by before the data-parallel sum (the step divides by
        dp_size / this after it): dp_size with prescale_gradients, else
        gradient_predivide_factor."""
        return float(dp_size) if self.prescale_gradients else self.gradient_predivide_factor

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        """The master's dtype: bf16 with bf16.bf16_master_weights_and_grads, else fp32."""
        return torch.bfloat16 if self.bf16.bf16_master_weights_and_grads else torch.float32

    @property
    def communication_dtype(self) -> torch.dtype | None:
        dtype = self.communication_data_type
        return None if dtype is None else _DTYPES[dtype]

    @property
    def sequence_comm_dtype(self) -> torch.dtype | None:
        """The Ulysses all-to-all's dtype on the wire (None: the activations' own)."""
        dtype = self.seq_parallel_communication_data_type
        return None if dtype is None else _DTYPES[dtype]

    @property
    def grad_dtype(self) -> torch.dtype:
        """What gradients are held, accumulated and reduce-scattered in:
        data_types.grad_accum_dtype, else the compute dtype at every stage (DeepSpeed's
        ``get_data_types``: the model dtype when grad_accum_dtype is not given)."""
        dtype = self.data_types.grad_accum_dtype
        return self.compute_dtype if dtype is None else _DTYPES[dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """What gradients are reduced in: communication_data_type, else the gradient dtype."""
        return self.communication_dtype or self.grad_dtype


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
    if tp.size > 1 and tp.plan is None and tp.autotp_size != tp.size:  # AutoTP: at initialize
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


def _autocast_problems(config: Config) -> list[str]:
    """torch_autocast computes in bf16 from fp32 parameters; fp16/bf16 training keeps 16-bit
    parameters: one or the other, as in DeepSpeed."""
    if not config.torch_autocast.enabled:
        return []
    both = [f"{key}.enabled" for key in ("fp16", "bf16") if getattr(config, key).enabled]
    problems = [f"torch_autocast.enabled and {key} are both true; enable one (torch_autocast "
                "keeps fp32 parameters, fp16/bf16 make them 16-bit)" for key in both]
    if config.pipeline_parallel.size > 1:
        problems.append("torch_autocast.enabled with pipeline_parallel.size > 1 is not "
                        "supported yet: the pipeline's stages run outside the autocast region")
    return problems


def _bf16_master_problems(config: Config) -> list[str]:
    """bf16 masters are the bf16 compute parameters, stepped on bf16 gradients."""
    if not config.bf16.bf16_master_weights_and_grads:
        return []
    key = "bf16.bf16_master_weights_and_grads"
    problems = []
    if not config.bf16.enabled:
        problems.append(f"{key} needs bf16.enabled: the master is the bf16 parameters")
    if config.data_types.grad_accum_dtype not in (None, "bf16"):
        problems.append(f"{key} keeps gradients in bf16, but data_types.grad_accum_dtype is "
                        f"{config.data_types.grad_accum_dtype!r}; drop one of them")
    if config.zero_optimization.offload_optimizer.device == "nvme":
        problems.append(f"{key} with offload_optimizer.device 'nvme' is not supported yet "
                        "(the NVMe files hold an fp32 master); use 'cpu' or 'none'")
    opt = config.optimizer
    if opt is not None and (opt.type not in ("Adam", "AdamW") or opt.params.get("amsgrad")):
        problems.append(f"{key} with optimizer.type {opt.type!r} (amsgrad "
                        f"{bool(opt.params.get('amsgrad'))}) is not supported: meshzero steps "
                        "bf16 masters with its own Adam (fp32 arithmetic); use Adam or AdamW")
    return problems

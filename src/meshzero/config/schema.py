"""The whole ds_config: its sections, and the rules that tie keys of different sections
together. Each default lives on its field and each rule in one place: the estimator reads a
`Config` rather than restating them."""

from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from meshzero.config.batch import (
    batch_problems,
    check_pipeline_batches,
    data_parallel_size,
    resolve_batch,
)
from meshzero.config.compile import CompileConfig, compile_problems
from meshzero.config.errors import ConfigError
from meshzero.config.faults import FaultsConfig
from meshzero.config.layer_drop import LayerDropConfig
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
    compile: CompileConfig = Field(default_factory=CompileConfig)  # torch.compile per unit
    sequence_parallel_size: PosInt = 1  # Ulysses (config/sequence.py)
    seq_parallel_communication_data_type: SeqCommDtype | None = None
    dataloader_drop_last: Bool = False  # the loader initialize builds from training_data
    progressive_layer_drop: LayerDropConfig = Field(default_factory=LayerDropConfig)
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
    # "auto" micro batch with no train_batch_size: known from the training data or the
    # first batch (data/batch.py)
    _micro_batch_pending: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "Config":
        pending = bool(info.context and info.context.get("micro_batch_pending"))
        problems = [] if pending else batch_problems(
            self.train_batch_size, self.train_micro_batch_size_per_gpu,
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
        problems += _mesh_problems(self) + sequence_problems(self) + compile_problems(self)
        if self.progressive_layer_drop.enabled and self.pipeline_parallel.size > 1:
            problems.append("progressive_layer_drop.enabled with pipeline_parallel.size > 1 "
                            "is not supported: pld_theta is passed to the model's forward, "
                            "which the pipeline's stages call themselves")
        problems += optimizer_problems(
            self.optimizer, tp_size=self.tensor_parallel.size, pp_size=self.pipeline_parallel.size,
            offload_optimizer=self.zero_optimization.offload_optimizer.device,
            bf16_states=self.bf16.bf16_optimizer_states, stage=self.zero_optimization.stage,
            bf16_master=self.bf16.bf16_master_weights_and_grads)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def resolve_batch(self, dp_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, gradient accumulation steps) for `dp_size`
        ranks, under train_batch_size == micro * accumulation * dp_size; with pipelining the
        accumulation steps must equal pipeline_parallel.micro_batches."""
        if self._micro_batch_pending:
            raise ConfigError(pending_micro_batch_message(self.pipeline_parallel.size > 1))
        batch = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                              self.gradient_accumulation_steps, dp_size)
        if self.pipeline_parallel.size > 1:
            check_pipeline_batches(self.pipeline_parallel.micro_batches, *batch, dp_size)
        return batch

    @property
    def micro_batch_pending(self) -> bool:
        """train_micro_batch_size_per_gpu is "auto" and nothing in the config gives it: the
        engine takes it from training_data's batch size or the first batch it sees."""
        return self._micro_batch_pending

    def batch_sizes(self, dp_size: int) -> tuple[int | None, int | None, int]:
        """`resolve_batch`, or ``(None, None, accumulation)`` while the micro batch is
        pending (refused with pipeline parallelism: its schedule needs it at initialize)."""
        if self._micro_batch_pending and self.pipeline_parallel.size == 1:
            return None, None, self.gradient_accumulation_steps or 1
        return self.resolve_batch(dp_size)

    def with_batch(self, train_batch_size: int, micro: int, accumulation: int) -> "Config":
        """A copy holding the resolved batch numbers (no longer pending)."""
        new = self.model_copy(update={"train_batch_size": train_batch_size,
                                      "train_micro_batch_size_per_gpu": micro,
                                      "gradient_accumulation_steps": accumulation})
        new._micro_batch_pending = False
        return new

    def with_micro_batch(self, micro: int) -> "Config":
        """A copy whose pending micro batch is ``micro`` (the batch rule then applies)."""
        new = self.model_copy(update={"train_micro_batch_size_per_gpu": micro})
        new._micro_batch_pending = False
        return new

    # -- DeepSpeed's dict: engine.config["zero_optimization"]["stage"] ----------------------------
    def as_dict(self) -> dict[str, Any]:
        """The resolved config as DeepSpeed's JSON dict ("auto" filled, defaults included,
        unset keys left out); a fresh copy each call (the config stays read-only)."""
        # not cached: a private cache would take part in pydantic's == of two configs
        return self.model_dump(mode="json", exclude_none=True)

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's ``config.get(key, default)`` on the resolved dict."""
        return self.as_dict().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self.as_dict())

    def values(self) -> list[Any]:
        return list(self.as_dict().values())

    def items(self) -> list[tuple[str, Any]]:
        return list(self.as_dict().items())

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

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
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16, or a float16 torch_autocast): the step then
        skips on an overflow as the loss scaler's business, and needs every gradient's
        finiteness before any unit steps."""
        return self.fp16.enabled or self.torch_autocast.scales_loss

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


def pending_micro_batch_message(pipeline: bool) -> str:
    """Why the batch numbers are not known yet, and what gives them."""
    if pipeline:
        return ('train_micro_batch_size_per_gpu is "auto" and train_batch_size is not a '
                "number: with pipeline_parallel.size > 1 the micro batch is needed at "
                "initialize; give train_micro_batch_size_per_gpu (or train_batch_size), or "
                "pass training_data as a torch DataLoader (its batch_size)")
    return ('train_micro_batch_size_per_gpu is "auto" and train_batch_size is not a number: '
            "the micro batch is taken from training_data (a DataLoader's batch_size) or from "
            "the leading dimension of the first batch engine(...) sees; give a number in the "
            "config to know it before")


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
    mesh = {"tensor_parallel.size": tp.size, "pipeline_parallel.size": pp.size,
            "sequence_parallel_size": config.sequence_parallel_size}
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                "zero_quantized_gradients"):
        for axis, size in mesh.items():
            if getattr(zc, key) and size > 1:
                problems.append(f"zero_optimization.{key} with {axis} = {size} is not "
                                "supported yet (ZeRO++ here quantizes the data-parallel "
                                "collectives of a dp-only mesh); drop one of them")
    gas = config.gradient_accumulation_steps
    if pp.size > 1 and pp.micro_batches is not None and gas is not None and gas != \
            pp.micro_batches:
        problems.append(f"pipeline_parallel.micro_batches ({pp.micro_batches}) != "
                        f"gradient_accumulation_steps ({gas}): with pipelining the micro-batches "
                        "of one step are the accumulation steps; give one of them")
    return problems


def _autocast_problems(config: Config) -> list[str]:
    """torch_autocast runs the forward under torch.autocast(dtype): from fp32 parameters
    (bf16, or float16 with torch's GradScaler loss scaling), or in bf16 with bf16.enabled
    from bf16 ones (DeepSpeed's bf16 + torch_autocast recipe: the ops autocast lists as
    fp32, losses and reductions, then compute in fp32). fp16 parameters under autocast are
    refused: two loss scalers (fp16's and the GradScaler DeepSpeed's ZeRO optimizers make
    for a float16 autocast) would both claim the loss."""
    ac = config.torch_autocast
    if not ac.enabled:
        return []
    problems = []
    if config.fp16.enabled:
        problems.append("torch_autocast.enabled and fp16.enabled are both true: not "
                        "supported (fp16's loss scaler and a float16 autocast's GradScaler "
                        "would both scale the loss); use torch_autocast with dtype "
                        "'float16' and fp32 parameters, or fp16.enabled alone")
    if config.bf16.enabled and ac.dtype == "float16":
        problems.append("torch_autocast.dtype 'float16' with bf16.enabled: bf16 parameters "
                        "under a float16 autocast would round twice; use dtype 'bfloat16' "
                        "with bf16, or float16 autocast alone")
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

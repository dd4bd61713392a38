"""Config sections for where model states live and how the model is split: offload
(DeepSpeed's keys) and the mesh (meshzero's own keys: tensor_parallel, pipeline_parallel,
topology)."""

from typing import Annotated, Literal

from pydantic import Field, Strict

from meshzero.config_types import Bool, NonNegInt, PosInt, _Model

# --- offload (zero_optimization.offload_optimizer / offload_param) ------------------------

OffloadDevice = Literal["none", "cpu", "nvme"]
NvmePath = Annotated[str, Strict(), Field(min_length=1)]


class OffloadOptimizerConfig(_Model):
    """`zero_optimization.offload_optimizer`: where the fp32 master, its gradient shard and
    the optimizer states live (stages 1-3). With nvme, buffer_count tiles of sub_group_size
    elements are in host memory at once."""

    device: OffloadDevice = "none"
    nvme_path: NvmePath | None = None
    pin_memory: Bool = False
    buffer_count: PosInt = 4
    fast_init: Bool = False


class OffloadParamConfig(_Model):
    """`zero_optimization.offload_param` (stage 3): where parameter shards live at rest.
    buffer_size and max_in_cpu are accepted for DeepSpeed configs; meshzero sizes its read
    buffers by the units it reads ahead (buffer_count of them)."""

    device: OffloadDevice = "none"
    nvme_path: NvmePath | None = None
    pin_memory: Bool = False
    buffer_count: PosInt = 5
    buffer_size: PosInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000


# --- the mesh (meshzero's own keys) ----------------------------------------------------------

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                      "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


class TensorParallelConfig(_Model):
    """`tensor_parallel` (meshzero's key; DeepSpeed's AutoTP keys are not accepted): size of
    the tp axis (inside a node), the plan (a shipped plan's name or {pattern: style}) and
    Megatron sequence parallelism."""

    size: PosInt = 1
    plan: Annotated[str, Strict(), Field(min_length=1)] | dict[str, str] | None = None
    sequence_parallel: Bool = False


class PipelineParallelConfig(_Model):
    """`pipeline_parallel` (meshzero's key): pp stages (across nodes), a
    torch.distributed.pipelining schedule, micro-batches per optimizer step (= the gradient
    accumulation steps), the model's layer list to split (attribute path, "" for the model
    itself), the modules run before it on the first stage and after it on the last, virtual
    stages per rank and optional explicit stage boundaries (first layer of stages 1..S-1)."""

    size: PosInt = 1
    schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"
    micro_batches: PosInt | None = None
    layers: Annotated[str, Strict()] = ""
    first: list[Annotated[str, Strict(), Field(min_length=1)]] = Field(default_factory=list)
    last: list[Annotated[str, Strict(), Field(min_length=1)]] = Field(default_factory=list)
    stages_per_rank: PosInt | None = None
    boundaries: list[NonNegInt] | None = None


class TopologyConfig(_Model):
    """`topology` (meshzero's key): ranks per node (default: torchrun's LOCAL_WORLD_SIZE),
    which decides what traffic counts as inside a node."""

    ranks_per_node: PosInt | None = None

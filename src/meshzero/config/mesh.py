"""How the model is split over ranks: meshzero's own keys tensor_parallel, pipeline_parallel
and topology."""

from typing import Annotated, Literal, get_args

from pydantic import Field, Strict

from meshzero.config.scalars import Bool, NonNegInt, PosInt, Section

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                          "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"]
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)


class TensorParallelConfig(Section):
    """`tensor_parallel`: size of the tp axis (inside a node), the plan (a shipped plan's name
    or {pattern: style}) and Megatron sequence parallelism. DeepSpeed's AutoTP key
    autotp_size > 1 sets size and leaves the plan to be inferred from the model at
    initialize (config.compat)."""

    size: PosInt = 1
    plan: Annotated[str, Strict(), Field(min_length=1)] | dict[str, str] | None = None
    sequence_parallel: Bool = False
    autotp_size: NonNegInt = 0


class PipelineParallelConfig(Section):
    """`pipeline_parallel` (meshzero's key): pp stages (across nodes), a
    torch.distributed.pipelining schedule, micro-batches per optimizer step (= the gradient
    accumulation steps), the model's layer list to split (attribute path, "" for the model
    itself), the modules run before it on the first stage and after it on the last, virtual
    stages per rank and optional explicit stage boundaries (first layer of stages 1..S-1)."""

    size: PosInt = 1
    schedule: PipelineSchedule = "1f1b"
    micro_batches: PosInt | None = None
    layers: Annotated[str, Strict()] = ""
    first: list[Annotated[str, Strict(), Field(min_length=1)]] = Field(default_factory=list)
    last: list[Annotated[str, Strict(), Field(min_length=1)]] = Field(default_factory=list)
    stages_per_rank: PosInt | None = None
    boundaries: list[NonNegInt] | None = None


class TopologyConfig(Section):
    """`topology` (meshzero's key): ranks per node (default: torchrun's LOCAL_WORLD_SIZE),
    which decides what traffic counts as inside a node."""

    ranks_per_node: PosInt | None = None

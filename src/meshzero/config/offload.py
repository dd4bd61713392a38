"""`zero_optimization.offload_optimizer` and `offload_param`: where model states live
(DeepSpeed's keys)."""

from typing import Annotated, Literal

from pydantic import Field, Strict

from meshzero.config.scalars import Bool, PosInt, Section

OffloadDevice = Literal["none", "cpu", "nvme"]
NvmePath = Annotated[str, Strict(), Field(min_length=1)]


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: where the fp32 master, its gradient shard and
    the optimizer states live (stages 1-3). With nvme, buffer_count tiles of sub_group_size
    elements are in host memory at once."""

    device: OffloadDevice = "none"
    nvme_path: NvmePath | None = None
    pin_memory: Bool = False
    buffer_count: PosInt = 4


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param` (stage 3): where parameter shards live at rest.
    meshzero sizes its read buffers by the units it reads ahead (buffer_count of them);
    DeepSpeed's buffer_size and max_in_cpu are accepted as hints (config.compat)."""

    device: OffloadDevice = "none"
    nvme_path: NvmePath | None = None
    pin_memory: Bool = False
    buffer_count: PosInt = 5

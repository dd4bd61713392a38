"""DeepSpeed's ds_config.json schema as typed, strict pydantic models.

`load_config` is the entry point: it accepts a dict, a path to a JSON file or an existing
`Config`, and turns every problem it finds into one `ConfigError` that lists each problem on its
own line with the dotted key, the value given and what is valid. Nothing is silently ignored:
unknown keys fail with the nearest valid key, DeepSpeed keys that would change results and that
meshzero does not implement fail saying so, and an "auto" meshzero cannot resolve fails with how
to resolve it. DeepSpeed's aliases, performance hints and values that ask for nothing load.

    scalars.py      strict int/float/bool types and the `Section` base (unknown keys refused)
    errors.py       ConfigError and the one-line-per-problem report
    unsupported.py  DeepSpeed keys that would change results and are not implemented
    compat.py       DeepSpeed's aliases, hints, no-op values and "auto", before validation
    monitor.py      `tensorboard`, `wandb`, `csv_monitor`
    table.py        the migration table (docs/migration-keys.md) rendered from all of these
    optimizer.py    `optimizer` and `scheduler`: a type and its params
    precision.py    `fp16`, `bf16`, `data_types`
    offload.py      `zero_optimization.offload_optimizer` / `offload_param`
    zero.py         `zero_optimization` and its cross-key rules
    mesh.py         `tensor_parallel`, `pipeline_parallel`, `topology`
    sequence.py     `sequence_parallel_size`, `seq_parallel_communication_data_type`
    profiler.py     `flops_profiler`
    faults.py       `faults`: non-finite gradients, the communication timeout
    batch.py        train_batch_size = micro * accumulation * dp
    schema.py       `Config`: the sections and the rules across them
    load.py         `load_config`
"""

from meshzero.config.errors import ConfigError
from meshzero.config.faults import FaultsConfig
from meshzero.config.load import load_config
from meshzero.config.mesh import PipelineParallelConfig, TensorParallelConfig, TopologyConfig
from meshzero.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from meshzero.config.optimizer import OptimizerConfig, SchedulerConfig
from meshzero.config.precision import BF16Config, FP16Config
from meshzero.config.profiler import FlopsProfilerConfig
from meshzero.config.schema import Config
from meshzero.config.zero import ZeroConfig

__all__ = [
    "BF16Config", "Config", "ConfigError", "FP16Config", "FaultsConfig", "FlopsProfilerConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "PipelineParallelConfig",
    "SchedulerConfig", "TensorParallelConfig", "TopologyConfig", "ZeroConfig", "load_config",
]

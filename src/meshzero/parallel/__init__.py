"""Model parallelism composed with ZeRO data parallelism."""

from meshzero.parallel.plans import GPT2_PLAN, GPT_PLAN, LLAMA_PLAN, TensorParallelContext
from meshzero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    TensorParallelLayer,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    is_tp_sharded,
)
from meshzero.parallel.tensor_state import gather_tensor_parallel_state_dict

__all__ = [
    "GPT2_PLAN",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardLayout",
    "TensorParallelContext",
    "TensorParallelLayer",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "gather_tensor_parallel_state_dict",
    "is_tp_sharded",
]

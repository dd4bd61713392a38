"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` module path: the
names of ``meshzero.deepspeed.checkpointing`` (the same objects, the same settings)."""

from meshzero.deepspeed.checkpointing import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

__all__ = ["CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "configure",
           "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]

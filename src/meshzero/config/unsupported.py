"""DeepSpeed keys that would change results and that meshzero does not implement yet.

An unknown-key error for one of these says so instead of suggesting the nearest key.
"""

# DeepSpeed keys that would change what training computes and that meshzero cannot honour:
# dotted key -> short note. A value that asks for nothing (false, {"enabled": false}) is
# accepted before it gets here (config.compat). Remove an entry (and add the field to its
# model) when the feature lands.
UNSUPPORTED_KEYS: dict[str, str] = {
    "amp": "NVIDIA apex AMP; use bf16 or fp16",
    "elasticity": "elastic training changes the batch size",
    "autotuning": "autotuner",
    "compression_training": "compression library",
    "data_efficiency": "data efficiency library (data sampling and routing)",
    "curriculum_learning": "curriculum learning",
    "eigenvalue": "eigenvalue computation",
    "hybrid_engine": "RLHF hybrid engine",
    "sparse_gradients": "sparse gradients",
    "nebula": "Nebula checkpoint service",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ quantized frozen weights",
    "zero_optimization.zeropp_loco_param": "ZeRO++ LoCo",
    "zero_optimization.zenflow": "ZenFlow (top-k gradient columns stepped on the GPU, the rest "
                                 "on the CPU every update_interval steps); "
                                 "offload_optimizer cpu steps every unit every step",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights",
    "scheduler.params.last_batch_iteration": "resume through the checkpoint instead",
    "gradient_allreduce_op": "'sum' adds the data-parallel gradients instead of averaging",
    "managed_gradient_accumulation": "gradient accumulation managed outside the engine",
    "quantize_training": "MoQ quantize-aware training",
    "weight_quantization": "weight quantization",
    "expert_parallel": "AutoEP MoE expert parallelism",
    "comet": "the Comet ML monitor; use tensorboard, wandb or csv_monitor",
}

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
    # DeepCompile's fields: below (at DeepSpeed's default they ask for nothing)
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

# DeepSpeed's DeepCompile options (deepspeed/compile/config.py, CompileConfig): key -> its
# default, which config.compat drops; any other value is refused as UNSUPPORTED_KEYS says.
DEEPCOMPILE_DEFAULTS: dict[str, object] = {
    "deepcompile": False, "free_activation": False,
    "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
    "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
    "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True,
    "keep_all_input_tensors": False, "passes": None,
}  # fmt: skip
UNSUPPORTED_KEYS.update({
    f"compile.{key}": "a DeepCompile option; meshzero runs no DeepCompile pass: it compiles "
                      "each ZeRO unit's forward instead (compile.enabled, engine.compile())"
    for key in DEEPCOMPILE_DEFAULTS})

"""ds_config key/value sets that public projects ship, written out as Python dicts.

Each entry is named by its source (repository and file or function). The values are the
projects' own; ``"auto"`` is left as they write it (the test fills it as Hugging Face's
Trainer would, and meshzero resolves the model-derived ones). Where a file is a template
with placeholders, the placeholders are given the values named in the comment. Entries named
"DeepSpeed docs ..." are key/value sets from DeepSpeed's documentation (config-json and the
tutorials) put together here, not copies of one file; DeepSpeed-Chat's come from its
get_train_ds_config / get_eval_ds_config functions.
"""

from __future__ import annotations

T, F = True, False

FP16_DYNAMIC = {"enabled": T, "loss_scale": 0, "loss_scale_window": 1000,
                "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}
FP16_AUTO = {**FP16_DYNAMIC, "enabled": "auto"}
HF_OPT = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                      "weight_decay": "auto"}}
HF_WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                            "warmup_num_steps": "auto"}}
HF_DECAY = {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
    "total_num_steps": "auto"}}
HF_BATCH = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
Z3_AUTO = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
           "stage3_param_persistence_threshold": "auto"}
OFFLOAD_CPU = {"device": "cpu", "pin_memory": T}
LF_Z012 = {"allgather_partitions": T, "allgather_bucket_size": 5e8, "overlap_comm": F,
           "reduce_scatter": T, "reduce_bucket_size": 5e8, "contiguous_gradients": T,
           "round_robin_gradients": T}
LF_TOP = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_allow_untested_optimizer": T, "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}}
LF_MONITOR = {"comms_config": {"verbose": F},
              "monitor_config": {"enabled": T, "tag": "DeepSpeedMonitor",
                                 "csv_monitor": {"enabled": F}}}
LF_Z3 = {"stage": 3, "overlap_comm": F, "contiguous_gradients": T, "sub_group_size": 1e9,
         **Z3_AUTO, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
         "stage3_gather_16bit_weights_on_model_save": T}
AXO_FP16 = {"enabled": "auto", "auto_cast": F, "loss_scale": 0, "initial_scale_power": 32,
            "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
AXO_TAIL = {**HF_BATCH, "wall_clock_breakdown": F}
AXO_Z3 = {"stage": 3, "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 0,
          **Z3_AUTO, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
          "stage3_gather_16bit_weights_on_model_save": T}
ACC_Z3 = {"stage": 3, "overlap_comm": T, "contiguous_gradients": T, **Z3_AUTO,
          "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9,
          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": "auto"}
ACC_OPT = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                       "torch_adam": T, "adam_w_mode": T}}
ACC_TAIL = {"gradient_accumulation_steps": 1, "gradient_clipping": "auto",
            "steps_per_print": 2000, "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": F}
HF_Z2 = {"stage": 2, "offload_optimizer": OFFLOAD_CPU, "allgather_partitions": T,
         "allgather_bucket_size": 2e8, "overlap_comm": T, "reduce_scatter": T,
         "reduce_bucket_size": 2e8, "contiguous_gradients": T}
ACC_Z2 = {"stage": 2, "allgather_partitions": T, "allgather_bucket_size": 2e8, "overlap_comm": T,
          "reduce_scatter": T, "reduce_bucket_size": "auto", "contiguous_gradients": T}
IMAGENET = {"train_batch_size": 256, "gradient_accumulation_steps": 1, "steps_per_print": 50,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                     "eps": 1e-8, "weight_decay": 3e-7}},
            "zero_allow_untested_optimizer": T, "gradient_clipping": 0, "prescale_gradients": F,
            "cuda_visible_devices": 0, "wall_clock_breakdown": F}
MDS_FP16 = {"enabled": T, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
            "min_loss_scale": 1, "initial_scale_power": 11}


def ds_chat(stage: int, dtype: str, offload: bool = False, lora: bool = False) -> dict:
    """DeepSpeedExamples applications/DeepSpeed-Chat dschat/utils/ds_utils.py
    get_train_ds_config(offload, dtype, stage) with its defaults (no hybrid engine, no
    TensorBoard); ``lora``: enable_mixed_precision_lora."""
    device = "cpu" if offload else "none"
    zero = {"stage": stage, "overlap_comm": T, "offload_param": {"device": device},
            "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": F}
    if lora:
        zero["zero_quantized_nontrainable_weights"] = T
    precision = ({"fp16": {"enabled": T, "loss_scale_window": 100}} if dtype == "fp16"
                 else {"bfloat16": {"enabled": T}})
    return {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
            "zero_optimization": zero, **precision, "gradient_clipping": 1.0,
            "prescale_gradients": F, "wall_clock_breakdown": F,
            "hybrid_engine": {"enabled": F, "max_out_tokens": 512, "inference_tp_size": 1,
                              "release_inference_cache": F, "pin_parameters": T,
                              "tp_gather_partition_size": 8},
            "tensorboard": {"enabled": F, "output_path": "/ds_tensorboard_logs/",
                            "job_name": "_tensorboard"}}


# name -> config. Every one of these must load and train one step.
LOADS: dict[str, dict] = {
    "transformers tests/deepspeed/ds_config_zero2.json": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}, "optimizer": HF_OPT,
        "scheduler": HF_WARMUP, "zero_optimization": HF_Z2, **HF_BATCH,
        "steps_per_print": 2000, "wall_clock_breakdown": F},
    "transformers tests/deepspeed/ds_config_zero3.json": {
        "fp16": FP16_DYNAMIC, "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 1e14,
            "reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_fp16_weights_on_model_save": T},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999],
                                                  "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                     "warmup_max_lr": 3e-5,
                                                     "warmup_num_steps": 500}},
        "steps_per_print": 2000, "wall_clock_breakdown": F},
    "transformers docs main_classes/deepspeed zero3 (auto)": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}, "optimizer": HF_OPT,
        "scheduler": HF_WARMUP, "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 1e9, **Z3_AUTO,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": T},
        **HF_BATCH, "steps_per_print": 2000, "wall_clock_breakdown": F},
    "accelerate deepspeed_config_templates/zero_stage1_config.json": {
        "bf16": {"enabled": T}, "optimizer": ACC_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {"stage": 1, "allgather_partitions": T,
                              "allgather_bucket_size": 2e8, "overlap_comm": T,
                              "reduce_scatter": T, "reduce_bucket_size": "auto",
                              "contiguous_gradients": T}, **ACC_TAIL},
    "accelerate deepspeed_config_templates/zero_stage2_config.json": {
        "fp16": FP16_DYNAMIC, "optimizer": ACC_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {"stage": 2, "allgather_partitions": T,
                              "allgather_bucket_size": 2e8, "overlap_comm": T,
                              "reduce_scatter": T, "reduce_bucket_size": "auto",
                              "contiguous_gradients": T}, **ACC_TAIL},
    "accelerate deepspeed_config_templates/zero_stage2_offload_config.json": {
        "fp16": FP16_DYNAMIC, "optimizer": ACC_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD_CPU,
                              "allgather_partitions": T, "allgather_bucket_size": 2e8,
                              "overlap_comm": T, "reduce_scatter": T,
                              "reduce_bucket_size": "auto", "contiguous_gradients": T},
        **ACC_TAIL},
    "accelerate deepspeed_config_templates/zero_stage3_config.json": {
        "bf16": {"enabled": T}, "optimizer": ACC_OPT, "scheduler": HF_DECAY,
        "zero_optimization": ACC_Z3, **ACC_TAIL},
    "accelerate deepspeed_config_templates/zero_stage3_offload_config.json": {
        "fp16": FP16_DYNAMIC, "optimizer": {"type": "AdamW", "params": {
            "lr": "auto", "weight_decay": "auto"}}, "scheduler": HF_DECAY,
        "zero_optimization": {**ACC_Z3, "offload_optimizer": OFFLOAD_CPU,
                              "offload_param": OFFLOAD_CPU}, **ACC_TAIL},
    "LLaMA-Factory examples/deepspeed/ds_z0_config.json": {
        **LF_TOP, "zero_optimization": {"stage": 0, **LF_Z012}, **LF_MONITOR},
    "LLaMA-Factory examples/deepspeed/ds_z2_config.json": {
        **LF_TOP, "zero_optimization": {"stage": 2, **LF_Z012}, **LF_MONITOR},
    "LLaMA-Factory examples/deepspeed/ds_z2_offload_config.json": {
        **LF_TOP, "zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD_CPU,
                                        **LF_Z012}, **LF_MONITOR},
    "LLaMA-Factory examples/deepspeed/ds_z3_config.json": {
        **LF_TOP, "zero_optimization": LF_Z3, **LF_MONITOR},
    "LLaMA-Factory examples/deepspeed/ds_z3_offload_config.json": {
        **LF_TOP, "zero_optimization": {**LF_Z3, "offload_optimizer": OFFLOAD_CPU,
                                        "offload_param": OFFLOAD_CPU}, **LF_MONITOR},
    "LLaMA-Factory examples/deepspeed/ds_z3_partial_offload_config.json": {
        **LF_TOP, "zero_force_ds_cpu_optimizer": T, "zero_optimization": {
            **LF_Z3, "offload_optimizer": {"device": "cpu", "pin_memory": F}}},
    "axolotl deepspeed_configs/zero1.json": {
        "zero_optimization": {"stage": 1, "overlap_comm": T}, "bf16": {"enabled": "auto"},
        "fp16": AXO_FP16, **AXO_TAIL},
    "axolotl deepspeed_configs/zero1_torch_compile.json": {
        "zero_optimization": {"stage": 1, "overlap_comm": T}, "bf16": {"enabled": "auto"},
        "fp16": AXO_FP16, "compile": {"disable": F, "backend": "inductor"}, **AXO_TAIL},
    "axolotl deepspeed_configs/zero2.json": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "contiguous_gradients": T, "overlap_comm": T},
        "bf16": {"enabled": "auto"}, "fp16": AXO_FP16, **AXO_TAIL},
    "axolotl deepspeed_configs/zero3.json": {
        "zero_optimization": AXO_Z3, "bf16": {"enabled": "auto"}, "fp16": AXO_FP16,
        **AXO_TAIL},
    "axolotl deepspeed_configs/zero3_bf16.json": {
        "zero_optimization": AXO_Z3, "bf16": {"enabled": T}, "fp16": AXO_FP16, **AXO_TAIL},
    "axolotl deepspeed_configs/zero3_bf16_cpuoffload_all.json": {
        "zero_force_ds_cpu_optimizer": F, "zero_allow_untested_optimizer": T,
        "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 0, **Z3_AUTO,
            "max_live_parameters": 0, "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": T},
        "bf16": {"enabled": T}, **AXO_TAIL},
    "axolotl deepspeed_configs/zero3_bf16_cpuoffload_params.json": {
        "zero_optimization": {
            "stage": 3, "offload_param": OFFLOAD_CPU, "overlap_comm": T,
            "contiguous_gradients": T, "sub_group_size": 0, **Z3_AUTO,
            "max_live_parameters": 0, "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": T},
        "bf16": {"enabled": T}, **AXO_TAIL},
    "bigscience jz/configs/deepspeed/ds_zero0.json": {
        "fp16": FP16_AUTO, "optimizer": HF_OPT, "scheduler": HF_WARMUP, **HF_BATCH,
        "steps_per_print": 2000, "wall_clock_breakdown": F},
    "bigscience jz/configs/deepspeed/ds_zero2.json": {
        "fp16": {**FP16_DYNAMIC, "initial_scale_power": 32}, "optimizer": HF_OPT,
        "scheduler": HF_DECAY, "zero_optimization": {
            "stage": 2, "allgather_partitions": T, "allgather_bucket_size": 3e8,
            "overlap_comm": T, "reduce_scatter": T, "reduce_bucket_size": 3e8,
            "contiguous_gradients": T, "cpu_offload": T},
        **HF_BATCH, "steps_per_print": 5000, "wall_clock_breakdown": F},
    "bigscience jz/configs/deepspeed/ds_zero3.json": {
        "fp16": FP16_DYNAMIC, "optimizer": HF_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 1e14, **Z3_AUTO,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_fp16_weights_on_model_save": T},
        **HF_BATCH, "steps_per_print": 5000, "wall_clock_breakdown": F},
    "stanford_alpaca configs/default_offload_opt_param.json": {
        "bf16": {"enabled": "auto"}, "optimizer": HF_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 1e9, **Z3_AUTO,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": F},
        **HF_BATCH, "steps_per_print": 5, "wall_clock_breakdown": F},
    "FastChat playground/deepspeed_config_s2.json": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "contiguous_gradients": T, "overlap_comm": T},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
    "FastChat playground/deepspeed_config_s3.json": {
        "fp16": FP16_AUTO, "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6, "sub_group_size": 1e12,
            "stage3_gather_16bit_weights_on_model_save": T},
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto"},
    "FastChat playground/deepspeed_config_lora_s3.json": {
        "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {
            "lr": "auto", "weight_decay": "auto"}}, "scheduler": HF_DECAY,
        "zero_optimization": {**ACC_Z3, "offload_optimizer": OFFLOAD_CPU,
                              "offload_param": OFFLOAD_CPU},
        **HF_BATCH, "steps_per_print": 2000, "wall_clock_breakdown": F},
    "DeepSpeedExamples training/cifar/ds_config.json": {
        "train_batch_size": 16, "steps_per_print": 250,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                 "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                     "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0, "prescale_gradients": F,
        "bf16": {"enabled": T, "bf16_master_weights_and_grads": F, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 15},
        "fp16": {"enabled": F, "fp16_master_weights_and_grads": F, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 15},
        "wall_clock_breakdown": F, "zero_optimization": {
            "stage": 0, "allgather_partitions": T, "reduce_scatter": T,
            "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
            "overlap_comm": T, "contiguous_gradients": T, "cpu_offload": F}},
    "DeepSpeed-Chat get_train_ds_config(offload=False, 'fp16', stage=2)": ds_chat(2, "fp16"),
    "DeepSpeed-Chat get_train_ds_config(offload=False, 'bf16', stage=3)": ds_chat(3, "bf16"),
    # ZeRO++ quantized frozen weights (docs/compression.md)
    "DeepSpeed-Chat get_train_ds_config(..., enable_mixed_precision_lora=True)":
        ds_chat(3, "bf16", lora=True),
    "DeepSpeed-Chat get_train_ds_config(offload=True, 'bf16', stage=3)":
        ds_chat(3, "bf16", offload=True),
    "DeepSpeed-Chat get_eval_ds_config(offload=False, 'fp16', stage=0)": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "none"},
                              "memory_efficient_linear": F},
        "fp16": {"enabled": T}, "gradient_clipping": 1.0, "prescale_gradients": F,
        "wall_clock_breakdown": F},
    "Megatron-DeepSpeed examples_deepspeed/rebase/ds_config_gbs256_mbs8_log1_zero1.json": {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 1,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
        "prescale_gradients": F, "fp16": MDS_FP16, "wall_clock_breakdown": F},
    "Megatron-DeepSpeed examples_deepspeed/sequence_parallel/..._gbs16_mbs1_log1_zero3": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
        "prescale_gradients": F, "fp16": MDS_FP16, "wall_clock_breakdown": F},
    "Megatron-DeepSpeed ds_zero2_config_bf16.json": {
        "train_batch_size": 96, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": T,
        "communication_data_type": "bfp16", "gradient_clipping": 1.0,
        "fp16": {"enabled": F, "loss_scale": 0, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bfloat16": {"enabled": T, "loss_scale": 1.0},
        "activation_checkpointing": {"partition_activations": T,
                                     "contiguous_memory_optimization": F},
        "wall_clock_breakdown": F,
        "flops_profiler": {"enabled": T, "profile_step": -1, "module_depth": -1,
                           "top_modules": 1, "detailed": T, "output_file": None}},
    # template: PRESCALE_GRAD true, ZERO_STAGE 1, CONFIG_FP16_ENABLED true, BF16 false,
    # curriculum and random-ltd off, batch 64 / micro 8
    "Megatron-DeepSpeed examples/random_ltd/configs/ds_config_gpt_TEMPLATE.json": {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
        "zero_optimization": {"stage": 1, "elastic_checkpoint": T},
        "gradient_clipping": 1.0, "prescale_gradients": T, "fp16": MDS_FP16,
        "bf16": {"enabled": F}, "curriculum_learning": {
            "enabled": F, "curriculum_type": "seqlen", "min_difficulty": 8,
            "max_difficulty": 1024, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}},
        "wall_clock_breakdown": F},
    "DeepSpeed docs config-json: fp16 + Adam + WarmupLR + ZeRO-2 example": {
        "train_batch_size": 8, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "fp16": {"enabled": T}, "zero_optimization": {"stage": 2}},
    "DeepSpeed docs tutorials/zero-offload (ZeRO-2 CPU offload)": {
        "train_batch_size": 8, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": T,
            "overlap_comm": T}, "fp16": {"enabled": T}},
    "DeepSpeed docs tutorials/zero (ZeRO-3 with CPU offload)": {
        "train_batch_size": 8, "zero_optimization": {
            "stage": 3, "contiguous_gradients": T, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
            "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"}}},
    "DeepSpeed docs tutorials/monitor (TensorBoard, W&B, CSV, all off)": {
        "train_batch_size": 8, "tensorboard": {"enabled": F, "output_path": "output/ds_logs/",
                                               "job_name": "train_bert"},
        "wandb": {"enabled": F, "team": "my_team", "group": "my_group",
                  "project": "my_project"},
        "csv_monitor": {"enabled": F, "output_path": "output/ds_logs/",
                        "job_name": "train_bert"}},
    "DeepSpeed docs tutorials/monitor (CSV monitor on)": {
        "train_batch_size": 8, "csv_monitor": {"enabled": T, "output_path": "{tmp}",
                                               "job_name": "train_bert"}},
    "DeepSpeed docs config-json: WarmupCosineLR + gradient_predivide_factor": {
        "train_batch_size": 8, "gradient_predivide_factor": 2.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "bias_correction": T}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.0001}},
        "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}},
    "DeepSpeed docs config-json: every documented fp16 key": {
        "train_batch_size": 8, "zero_optimization": {"stage": 1},
        "fp16": {"enabled": T, "auto_cast": T, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 1000, "hysteresis": 2,
                 "consecutive_hysteresis": T, "min_loss_scale": 1}},
    # the older "bfloat16" spelling, its "auto" filled as bf16's
    "transformers tests/deepspeed/ds_config_zero2_bf16.json": {
        "bfloat16": {"enabled": "auto"}, "optimizer": HF_OPT, "scheduler": HF_WARMUP,
        "zero_optimization": HF_Z2, **HF_BATCH, "steps_per_print": 2000,
        "wall_clock_breakdown": F},
    "transformers tests/deepspeed/ds_config_zero3_bf16.json": {
        "bfloat16": {"enabled": "auto"}, "optimizer": HF_OPT, "scheduler": HF_WARMUP,
        "zero_optimization": {
            "stage": 3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU,
            "overlap_comm": T, "contiguous_gradients": T, "sub_group_size": 1e9, **Z3_AUTO,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_fp16_weights_on_model_save": T},
        **HF_BATCH, "steps_per_print": 2000, "wall_clock_breakdown": F},
    # Accelerate's own test configs (tests/deepspeed): "auto" in keys only Accelerate fills
    "accelerate tests/deepspeed/ds_config_zero2.json": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}, "optimizer": ACC_OPT,
        "scheduler": HF_WARMUP, "zero_optimization": {**ACC_Z2, "offload_optimizer": OFFLOAD_CPU},
        **ACC_TAIL},
    "accelerate tests/deepspeed/ds_config_zero2_model_only.json": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"},
        "zero_optimization": {**ACC_Z2, "offload_optimizer": OFFLOAD_CPU}, **ACC_TAIL},
    "accelerate tests/deepspeed/ds_config_zero3.json": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}, "optimizer": ACC_OPT,
        "scheduler": HF_WARMUP, "zero_optimization": {
            **ACC_Z3, "offload_optimizer": OFFLOAD_CPU, "offload_param": OFFLOAD_CPU},
        **ACC_TAIL},
    "accelerate tests/deepspeed/ds_config_zero3_model_only.json": {
        "fp16": FP16_AUTO, "bf16": {"enabled": "auto"}, "zero_optimization": {
            "stage": 3, "offload_param": OFFLOAD_CPU, "overlap_comm": T, "sub_group_size": 1e9,
            "reduce_bucket_size": 1e9, "stage3_prefetch_bucket_size": 1e9,
            "stage3_param_persistence_threshold": 1e9, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": T},
        "train_micro_batch_size_per_gpu": 1},
    "DeepSpeedExamples training/autotuning/hf/dsconfigs/ds_config_fp16_z2.json": {
        "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
        "fp16": {"enabled": T}},
    "DeepSpeedExamples training/autotuning/hf/dsconfigs/ds_config_z3.json": {
        "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}},
    "DeepSpeedExamples training/gan/gan_deepspeed_config.json": {
        "train_batch_size": 64, "steps_per_print": 10, "optimizer": {
            "type": "Adam", "params": {"lr": 0.0002, "betas": [0.5, 0.999], "eps": 1e-8}}},
    # cuda_visible_devices is no DeepSpeed key: ignored with a warning, as DeepSpeed does
    "DeepSpeedExamples training/imagenet/config/ds_config.json": {
        **IMAGENET, "zero_optimization": {"stage": 0}, "fp16": {"enabled": F}},
    "DeepSpeedExamples training/imagenet/config/ds_fp16_z1_config.json": {
        **IMAGENET, "zero_optimization": {"stage": 1}, "fp16": {"enabled": T, "auto_cast": T}},
    "DeepSpeedExamples training/pipeline_parallelism/ds_config.json": {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                 "eps": 1e-8}}, "wall_clock_breakdown": F},
    "DeepSpeedExamples compression/cifar/config/ds_config.json": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 32, "steps_per_print": 50,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                 "eps": 1e-8, "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 0}, "fp16": {"enabled": T}, "gradient_clipping": 1.0,
        "prescale_gradients": T, "wall_clock_breakdown": F},
    "DeepSpeedExamples training/bf16_master_weight/configs/baseline.json": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "steps_per_print": 100, "optimizer": {"type": "AdamW", "params": {
            "lr": 0.0001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "bf16": {"enabled": T}, "zero_optimization": {
            "stage": 3, "overlap_comm": T, "contiguous_gradients": T,
            "reduce_bucket_size": 5e7, "stage3_param_persistence_threshold": 0},
        "torch_autocast": {"enabled": F}},
}

# name -> (config, the dotted keys the one error must name). Each would change what
# training computes in a way meshzero cannot honour.
REFUSED: dict[str, tuple[dict, tuple[str, ...]]] = {
    "Megatron-DeepSpeed data_efficiency bert template (curriculum + random-ltd on)": (
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
         "zero_optimization": {"stage": 1, "allgather_bucket_size": "auto"},
         "fp16": MDS_FP16, "gradient_clipping": 1.0, "prescale_gradients": F,
         "wall_clock_breakdown": F,
         "data_efficiency": {"enabled": T, "seed": 1234, "data_routing": {
             "enabled": T, "random_ltd": {"enabled": T}}}},
        # allgather_bucket_size "auto" is not one Hugging Face resolves either
        ("data_efficiency", "zero_optimization.allgather_bucket_size")),
    "DeepSpeedExamples training/data_efficiency/gpt_finetuning/config/"
    "ds_config_gpt_base_random_ltd.json": (
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
         "optimizer": {"type": "Adam", "params": {"lr": 0.0001, "betas": [0.8, 0.999],
                                                  "eps": 1e-8, "weight_decay": 3e-7}},
         "zero_optimization": {"stage": 0}, "fp16": {"enabled": F}, "gradient_clipping": 1.0,
         "prescale_gradients": T, "wall_clock_breakdown": F,
         "data_efficiency": {"enabled": T, "data_routing": {"enabled": T, "random_ltd": {
             "enabled": T, "total_layer_num": 12, "random_ltd_layer_num": 10,
             "random_ltd_layer_id": list(range(1, 11)), "model_mask_name": "attention_mask",
             "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
             "random_ltd_schedule": {"min_value": 128, "max_value": 1024,
                                     "schedule_type": "fixed_linear", "schedule_config": {
                                         "require_steps": 400, "seq_per_step": 8}}}}}},
        ("data_efficiency",)),
}

# AutoTP, loaded without the model (the plan is inferred at initialize): name -> config
AUTOTP_ALONE: dict[str, dict] = {
    "DeepSpeedExamples training/tensor_parallel/hf_integration/configs/ds_config.json": {
        "bf16": {"enabled": "auto"}, "optimizer": HF_OPT, "scheduler": HF_DECAY,
        "zero_optimization": {"stage": 2, "gather_16bit_weights_on_model_save": T},
        "tensor_parallel": {"autotp_size": 4}, **HF_BATCH, "steps_per_print": 1,
        "wall_clock_breakdown": F},
}

# issue 25: LAMB, bias_correction false, torch_autocast and bf16 states/masters now load
# ("written here": not one project's file, the keys as DeepSpeed documents them)
LOADS.update({
    "DeepSpeed docs tutorials/bert-pretraining (Lamb, fp16)": {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
        "prescale_gradients": F, "optimizer": {"type": "Lamb", "params": {
            "lr": 11e-3, "weight_decay": 0.01, "bias_correction": F, "max_coeff": 0.3,
            "min_coeff": 0.01}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": F,
        "fp16": {"enabled": T, "loss_scale": 0}},
    "written here: Adam with bias_correction false (the BERT-era setting), CPU offload": {
        "train_batch_size": 8, "optimizer": {"type": "Adam", "params": {
            "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01,
            "bias_correction": F}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "DeepSpeed docs torch_autocast (bfloat16, safe modules)": {
        "train_batch_size": 8, "torch_autocast": {
            "enabled": T, "dtype": "bfloat16",
            "lower_precision_safe_modules": ["torch.nn.Linear", "torch.nn.Conv2d"]},
        "zero_optimization": {"stage": 3}},
    "written here: bf16 with DeepSpeed's bf16_optimizer_states and master keys": {
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": T, "bf16_optimizer_states": T,
                 "bf16_master_weights_and_grads": T},
        "zero_optimization": {"stage": 2}},
})

# AutoTP: loads (tp 2 over the plan inferred for the model); at world size 1 it cannot run,
# as in DeepSpeed, and initialize says so naming tensor_parallel.size.
AUTOTP = ("LLaMA-Factory examples/deepspeed/ds_z2_autotp_config.json", {
    "_comment": "supported model list: https://www.deepspeed.ai/tutorials/automatic-"
                "tensor-parallelism/#supported-models", **LF_TOP,
    "zero_optimization": {"stage": 2, **LF_Z012}, "tensor_parallel": {"autotp_size": 2}})

# issue 36: 1-bit Adam (stage 0) and progressive layer drop now load
LOADS.update({
    "DeepSpeed docs onebit-adam tutorial": {
        "train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {
            "lr": 4e-4, "freeze_step": 23000, "cuda_aware": F, "comm_backend_name": "nccl"}},
        "fp16": {"enabled": T}},
    "DeepSpeed docs progressive-layer-drop tutorial (PLD on, Adam)": {
        "train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "fp16": {"enabled": T, "loss_scale": 0},
        "progressive_layer_drop": {"enabled": T, "theta": 0.5, "gamma": 0.001}},
    "DeepSpeed tests TestTorchAutocastWithPrecisionModes (bf16 + torch_autocast, stage 2)": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "steps_per_print": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "torch_autocast": {"enabled": T, "dtype": "torch.bfloat16"},
        "bf16": {"enabled": T, "bf16_master_weights_and_grads": T,
                 "bf16_optimizer_states": T},
        "zero_optimization": {"stage": 2}},
})

"""``deepspeed.runtime.pipe``: the rank-grid topologies Megatron-DeepSpeed and gpt-neox build."""

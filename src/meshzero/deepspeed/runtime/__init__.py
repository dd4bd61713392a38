"""``deepspeed.runtime``: the modules real code imports names from (engine, zero, dataloader,
config)."""

"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module is
``meshzero.deepspeed.checkpointing``."""

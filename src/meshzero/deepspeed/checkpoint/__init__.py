"""``deepspeed.checkpoint``: the package of ``deepspeed.checkpoint.utils``."""

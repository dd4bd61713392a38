"""``deepspeed.checkpoint``: the checkpoint helpers real code imports (``utils``)."""

"""DeepSpeed's ``deepspeed.moe``: ``utils`` (MoE optimizer-group helpers) and ``layer.MoE``
(raises: meshzero trains plain-torch MoE models data-parallel)."""

from meshzero.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]

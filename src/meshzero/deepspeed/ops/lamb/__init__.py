"""DeepSpeed's ``deepspeed.ops.lamb``: ``FusedLamb`` over meshzero's LAMB."""

from meshzero.deepspeed.ops.lamb.fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

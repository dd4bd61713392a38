"""DeepSpeed's ``deepspeed.ops.op_builder``: its extension builders, none built by meshzero
(``builder.py``)."""

from meshzero.deepspeed.ops.op_builder.builder import (
    ALL_OPS,
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    GDSBuilder,
    InferenceBuilder,
    OpBuilder,
    QuantizerBuilder,
    SparseAttnBuilder,
    TransformerBuilder,
)

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder",
           "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "GDSBuilder",
           "InferenceBuilder", "OpBuilder", "QuantizerBuilder", "SparseAttnBuilder",
           "TransformerBuilder"]

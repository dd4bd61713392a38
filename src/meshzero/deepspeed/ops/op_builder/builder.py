"""DeepSpeed's ``deepspeed.ops.op_builder``: the builders of its C++/CUDA extensions. meshzero
compiles none: a builder reports itself not compatible and ``load()`` raises naming what
meshzero uses instead; ``OpBuilder.is_rocm_pytorch()`` (Megatron-DeepSpeed asks it at import)
answers from torch."""

from __future__ import annotations

from typing import Any

import torch

# what meshzero uses where DeepSpeed would load the op
_INSTEAD = {
    "async_io": "meshzero's NVMe tier (offload to nvme in the config) uses os.pread/pwrite "
                "threads",
    "gds": "meshzero's NVMe tier (offload to nvme in the config) uses os.pread/pwrite threads",
    "cpu_adam": "meshzero.deepspeed.ops.adam.DeepSpeedCPUAdam steps with torch's fused Adam",
    "fused_adam": "meshzero.deepspeed.ops.adam.FusedAdam steps with torch's fused Adam",
    "fused_lamb": "meshzero.deepspeed.ops.lamb.FusedLamb is meshzero's Lamb",
    "cpu_adagrad": "meshzero.deepspeed.ops.adagrad.DeepSpeedCPUAdagrad is torch's Adagrad",
}


class OpBuilder:
    """DeepSpeed's `deepspeed.ops.op_builder.builder.OpBuilder`: builds nothing in meshzero."""

    NAME = "op"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """DeepSpeed's `OpBuilder.is_rocm_pytorch`: whether torch is a ROCm build."""
        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_cuda_version(name: str = "") -> tuple[int, int]:
        """DeepSpeed's `OpBuilder.installed_cuda_version`: torch's CUDA version (major, minor)."""
        version = torch.version.cuda
        if version is None:
            raise ValueError("installed_cuda_version: this torch is not a CUDA build")
        major, minor = version.split(".")[:2]
        return int(major), int(minor)

    def absolute_name(self) -> str:
        """DeepSpeed's `OpBuilder.absolute_name`: the op's module path in DeepSpeed."""
        return f"deepspeed.ops.{self.name}.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """DeepSpeed's `OpBuilder.is_compatible`: False: meshzero compiles no extension."""
        return False

    def load(self, verbose: bool = True) -> Any:
        """DeepSpeed's `OpBuilder.load`: raises, naming what meshzero uses instead."""
        instead = _INSTEAD.get(self.name, "meshzero runs on torch's own kernels")
        raise NotImplementedError(f"{type(self).__name__}().load(): meshzero builds no "
                                  f"DeepSpeed extension ({self.name}); {instead}")

    def builder(self) -> Any:
        """DeepSpeed's `OpBuilder.builder`: raises as load() does."""
        return self.load()


def _builder(class_name: str, op_name: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {
        "NAME": op_name,
        "__doc__": f"DeepSpeed's `deepspeed.ops.op_builder.{class_name}`: not built in meshzero.",
        "__module__": __name__})


AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io")
GDSBuilder = _builder("GDSBuilder", "gds")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference")
TransformerBuilder = _builder("TransformerBuilder", "transformer")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer")
SparseAttnBuilder = _builder("SparseAttnBuilder", "sparse_attn")

ALL_OPS = {b.NAME: b for b in (AsyncIOBuilder, GDSBuilder, CPUAdamBuilder, FusedAdamBuilder,
                               FusedLambBuilder, CPUAdagradBuilder, CPULionBuilder,
                               FusedLionBuilder, InferenceBuilder, TransformerBuilder,
                               QuantizerBuilder, SparseAttnBuilder)}

"""The profiler that tells the truth: FLOPs, parameters, time, memory and communication per
rank, under any sharding."""

from meshzero.profiling.report import ModuleRow, ProfileReport
from meshzero.profiling.step import get_model_profile

__all__ = ["ModuleRow", "ProfileReport", "get_model_profile"]

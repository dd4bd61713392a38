"""``deepspeed.zero.partition_parameters``: the same module as
``deepspeed.runtime.zero.partition_parameters`` (DeepSpeed exposes it under both names)."""

from meshzero.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]

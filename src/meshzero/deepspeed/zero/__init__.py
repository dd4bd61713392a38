"""``deepspeed.zero``: ``Init``, ``GatheredParameters`` and external parameters, mapped onto
``meshzero.zero_init`` and meshzero's gathered parameters."""

from meshzero.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from meshzero.deepspeed.zero import partition_parameters

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters",
           "register_external_parameter", "unregister_external_parameter"]

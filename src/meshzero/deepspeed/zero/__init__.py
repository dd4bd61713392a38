"""``deepspeed.zero``: ``Init``, ``GatheredParameters`` and external parameters, mapped onto
``meshzero.zero_init`` and meshzero's gathered parameters."""

from meshzero.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from meshzero.deepspeed.zero import partition_parameters  # noqa: F401  (DeepSpeed's path)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]

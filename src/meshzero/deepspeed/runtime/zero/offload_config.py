"""DeepSpeed's `deepspeed.runtime.zero.offload_config`: the enums `offload_states` takes."""

from __future__ import annotations

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`: offload devices."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum`: state kinds.

    What ``engine.offload_states(include=...)`` names: the optimizer states, the fp32 master
    (hp) and compute (lp) parameters, the gradients and the contiguous gradient buffer."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"

"""``deepspeed.runtime.zero.offload_config``: the enums RLHF code passes to
``offload_states`` (``OffloadDeviceEnum.cpu``, ``OffloadStateTypeEnum.optim_states``)."""

from __future__ import annotations

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`: where an
    offload goes; the string values of the config's `offload_*.device`."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum`: the state
    categories `engine.offload_states(include=...)` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"

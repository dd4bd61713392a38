"""DeepSpeed's ``deepspeed.utils.groups``: the process-group queries real code makes, mapped
onto ``torch.distributed``'s world as DeepSpeed answers them without an ``mpu``.

meshzero keeps no process-wide groups (an engine's are in ``engine.topology``): here data
parallelism is the world, tensor/model parallelism is 1, and expert parallelism is 1 (every
rank holds every expert: meshzero trains MoE models data-parallel), so an expert's
data-parallel group is the world too. An engine built with ``tensor_parallel`` or
``pipeline_parallel`` answers from ``engine.topology`` (``dp_size``, ``dp_group``, ...).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's `deepspeed.utils.groups.initialize`: ep_size 1 and no mpu (else raises)."""
    if ep_size != 1 or mpu is not None:
        raise ValueError(f"groups.initialize(ep_size={ep_size}, mpu={mpu!r}): meshzero has no "
                         "expert parallelism and takes an mpu only through initialize(mpu=)")


def _get_data_parallel_group() -> Any:
    """DeepSpeed's `deepspeed.utils.groups._get_data_parallel_group`: the world group."""
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_data_parallel_world_size`: the world size."""
    return _world_size()


def _get_data_parallel_rank() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_data_parallel_rank`: the global rank."""
    return _rank()


def _get_data_parallel_group_ranks() -> list[int]:
    """DeepSpeed's `deepspeed.utils.groups._get_data_parallel_group_ranks`: every rank."""
    return list(range(_world_size()))


def _get_broadcast_src_rank() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_broadcast_src_rank`: 0."""
    return 0


def _get_model_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_model_parallel_world_size`: 1."""
    return 1


def get_tensor_model_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups.get_tensor_model_parallel_world_size`: 1."""
    return 1


def get_tensor_model_parallel_rank() -> int:
    """DeepSpeed's `deepspeed.utils.groups.get_tensor_model_parallel_rank`: 0."""
    return 0


def get_data_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups.get_data_parallel_world_size`: the world size."""
    return _world_size()


def _get_sequence_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_sequence_parallel_world_size`: 1."""
    return 1


def _get_sequence_parallel_rank() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_sequence_parallel_rank`: 0 (no sp group)."""
    return 0


def _get_sequence_parallel_group() -> Any:
    """DeepSpeed's `deepspeed.utils.groups._get_sequence_parallel_group`: raises KeyError as
    DeepSpeed's does without an sp group (meshzero's Ulysses is the config's
    sequence_parallel_size; its group is the engine's ``topology.sp_group``)."""
    raise KeyError("No sequence parallel group found: meshzero's Ulysses group is "
                   "engine.topology.sp_group (config sequence_parallel_size)")


def _get_sequence_data_parallel_world_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_sequence_data_parallel_world_size`: world size."""
    return _world_size()


def _get_sequence_data_parallel_group() -> Any:
    """DeepSpeed's `deepspeed.utils.groups._get_sequence_data_parallel_group`: the world."""
    return dist.group.WORLD


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_expert_parallel_world_size`: 1 (no EP)."""
    return 1


def _get_expert_parallel_rank(group_name: str = "") -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_expert_parallel_rank`: 0 (no EP)."""
    return 0


def _get_expert_data_parallel_world_size(group_name: str = "") -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_expert_data_parallel_world_size`: world size."""
    return _world_size()


def _get_expert_data_parallel_group(group_name: str = "") -> Any:
    """DeepSpeed's `deepspeed.utils.groups._get_expert_data_parallel_group`: the world."""
    return dist.group.WORLD


def _get_max_expert_size() -> int:
    """DeepSpeed's `deepspeed.utils.groups._get_max_expert_size`: 1 (no EP)."""
    return 1

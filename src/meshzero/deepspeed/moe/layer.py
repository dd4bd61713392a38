"""DeepSpeed's ``deepspeed.moe.layer.MoE``: not built by meshzero (expert parallelism is not
implemented); an MoE model written in plain torch trains data-parallel under meshzero."""

from __future__ import annotations

from typing import Any

from torch import nn


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE`: raises, naming meshzero's way (plain torch)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, **kwargs: Any) -> None:
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE: meshzero has no expert parallelism; write the gate and "
            "experts as plain torch modules (meshzero trains them data-parallel, every rank "
            "holding every expert) and split optimizer groups with "
            "meshzero.deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")

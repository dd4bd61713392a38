"""A tensor-parallel model's whole tensors: every tp rank's shard all-gathered and unsharded
(state dicts for equivalence tests, 16-bit model files)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import all_gather_into
from meshzero.parallel.shards import ShardLayout, unshard_tensor
from meshzero.parallel.tensor import TensorParallelLayer
from meshzero.parallel.tensor_comms import group_size


@torch.no_grad()
def gather_tensor_parallel_state_dict(model: nn.Module, tp_group: dist.ProcessGroup | None
                                      ) -> dict[str, torch.Tensor]:
    """The model's state dict with every tp-sharded parameter all-gathered into its full
    tensor, under its original name and in its original shape and orientation (a converted
    ``Conv1D`` weight comes back as (in, out)). Collective: every tp rank must call it."""
    owners: dict[str, tuple[torch.Tensor, ShardLayout]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TensorParallelLayer):
            for name, layout in module.tp_layouts.items():
                owners[f"{prefix}.{name}" if prefix else name] = (getattr(module, name), layout)
    full_of: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in owners:
            out[key] = value.detach().clone()
            continue
        shard, layout = owners[key]
        if id(shard) not in full_of:
            full_of[id(shard)] = gather_tp_tensor(shard, layout, tp_group)
        out[key] = full_of[id(shard)]
    return out


def gather_tp_tensor(shard: torch.Tensor, layout: ShardLayout,
                     tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole tensor from every tp rank's ``shard`` (its original shape and orientation);
    collective over ``tp_group``."""
    shard = shard.detach().contiguous()
    n = group_size(tp_group)
    if n == 1:
        return unshard_tensor([shard], layout)
    flat = shard.new_empty(n * shard.numel())  # (N * numel,): rank r's shard r-th
    all_gather_into(flat, shard.reshape(-1), tp_group)
    return unshard_tensor(list(flat.view(n, *shard.shape).unbind(0)), layout)

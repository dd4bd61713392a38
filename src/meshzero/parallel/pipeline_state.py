"""The full state dict of a pipeline-parallel model, gathered from its stages (tests and small
models: the whole model moves through one rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshzero.comm import all_gather_objects, gather_objects
from meshzero.parallel.pipeline import Pipeline


def gather_pipeline_state_dict(
    pipeline: Pipeline, *, dst: int | None = None
) -> dict[str, torch.Tensor] | None:
    """The full model's state dict (CPU tensors, the original model's keys and order) from
    every stage: on every pp rank, or only on pp rank ``dst`` (None elsewhere). A collective
    over the pp group that moves the whole model through one rank: for tests and small
    models, not for checkpoints of large ones."""
    local = {k: v.detach().to("cpu", copy=True) for k, v in pipeline.module.state_dict().items()}
    if dst is None:
        parts = all_gather_objects(local, pipeline.pp_group)
    else:
        gathered = gather_objects(local, dist.get_global_rank(pipeline.pp_group, dst),
                                  pipeline.pp_group)
        if gathered is None:
            return None
        parts = gathered
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        assert part is not None
        for key, value in part.items():
            merged.setdefault(key, value)  # a tied tensor: equal on every holder
    missing = [k for k in pipeline.state_dict_keys if k not in merged]
    assert not missing, f"no stage holds {missing}"
    return {k: merged[k] for k in pipeline.state_dict_keys}

"""How a tensor-parallel parameter is cut from its full tensor, and put back together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

# param -> True (each tp rank holds a different slice) or False (replicated inside a
# parallel layer); written by the parallel layers, keyed by identity, dropped with the param
_TP_SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class ShardLayout:
    """How a local parameter is cut from its full tensor.

    The full tensor (in the local layer's orientation) has ``num_fused`` equal parts along
    ``dim`` (e.g. q, k and v of a fused projection); each part is cut into tp equal pieces
    and a rank's shard is its piece of every part, concatenated. ``transposed``: the original
    module stored the transpose (Hugging Face ``Conv1D`` keeps weights as (in, out)).
    """

    dim: int
    num_fused: int = 1
    transposed: bool = False


def shard_tensor(full: torch.Tensor, layout: ShardLayout, tp_size: int, tp_rank: int
                 ) -> torch.Tensor:
    """This rank's shard of ``full`` (already in the local orientation), a fresh tensor."""
    parts = full.chunk(layout.num_fused, dim=layout.dim)
    pieces = [part.chunk(tp_size, dim=layout.dim)[tp_rank] for part in parts]
    return torch.cat(pieces, dim=layout.dim).clone()


def unshard_tensor(shards: list[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """The full tensor, in the original module's orientation, from every rank's shard."""
    per_rank = [s.chunk(layout.num_fused, dim=layout.dim) for s in shards]
    parts = [torch.cat([chunks[f] for chunks in per_rank], dim=layout.dim)
             for f in range(layout.num_fused)]
    full = torch.cat(parts, dim=layout.dim)
    return full.t().contiguous() if layout.transposed else full


def mark_tp_sharded(param: torch.Tensor, sharded: bool) -> None:
    """Record whether each tp rank holds a different slice of ``param``."""
    _TP_SHARDED[param] = sharded


def is_tp_sharded(param: torch.Tensor) -> bool | None:
    """True if each tp rank holds a different slice of this parameter, False if a parallel
    layer holds it replicated, None if no parallel layer holds it (also replicated)."""
    return _TP_SHARDED.get(param)

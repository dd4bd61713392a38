"""``gathered_parameters(params, modifier_rank)``: the full values of bare parameters, for
code that holds parameters but no engine (DeepSpeed's ``GatheredParameters`` is called so).

Each parameter goes where it lives:

    held by an engine     that engine's ``gathered`` (zero/state.py; found through
                          zero/owners.py): stage 3 gathers, and a ``modifier_rank``'s writes
                          reach every rank's shard, master and compute parameters
    on the meta device    built under ``zero_init``: made real on the spot (zero/early.py)
    anything else         already full: with ``modifier_rank``, broadcast from that global
                          rank on exit (a plain model before initialize)

A collective when any rank may hold sharded parameters or a ``modifier_rank`` is given:
enter it on every rank with the same parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshzero.zero.early import gathered_meta
from meshzero.zero.owners import owner_of

if TYPE_CHECKING:
    from meshzero.zero.state import ZeroModelState


def _broadcast_plain(params: list[torch.Tensor], src: int) -> None:
    if not params or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    with torch.no_grad():
        for p in params:
            moved = p.detach().to(device)
            dist.broadcast(moved, src=src)
            p.detach().copy_(moved)


@contextmanager
def gathered_parameters(params: Iterable[torch.Tensor],
                        modifier_rank: int | None = None) -> Iterator[None]:
    """Full ``params`` inside the block, wherever they live (see the module docstring);
    ``modifier_rank``: the rank whose writes are kept (a data-parallel rank for parameters
    an engine holds, a global rank otherwise); None: read-only."""
    params = list(dict.fromkeys(params))
    owned: dict[int, tuple[ZeroModelState, list[torch.Tensor]]] = {}
    meta, plain = [], []
    for p in params:
        state = owner_of(p)
        if state is not None:
            owned.setdefault(id(state), (state, []))[1].append(p)
        elif p.is_meta:
            meta.append(p)
        else:
            plain.append(p)
    with ExitStack() as stack:
        for state, mine in owned.values():
            stack.enter_context(state.gathered(mine, modifier_rank))
        if meta:
            stack.enter_context(gathered_meta(meta, modifier_rank))
        yield
        if modifier_rank is not None:
            _broadcast_plain(plain, modifier_rank)

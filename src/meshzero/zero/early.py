"""Gathered parameters before ``initialize``: a model built under ``zero_init`` is on the
meta device, but code reads and writes its parameters right after building it (Hugging Face
runs ``_init_weights`` and copies rows into a resized embedding inside DeepSpeed's
``GatheredParameters(..., modifier_rank=0)``).

Inside such a block each meta parameter's module is made real on the spot, as the engine
would make it at initialize (zero/materialize.py): its own meta parameters and buffers get
CPU memory and its init runs with the draws recorded at construction replayed, so the
values are the ones the engine would give. The real tensors replace the meta ones in every
module that holds them (read them from the module inside the block: the meta object passed
in cannot change device in place). On exit:

    modifier_rank r   rank r's values are broadcast (global ranks: there is no engine yet)
                      and kept: the engine takes them as they are and runs no init on
                      these modules (the record's ``early_*`` sets)
    None              read-only: the meta parameters go back, and initialize materialises
                      them as usual (the block's writes are lost, as DeepSpeed's are)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from meshzero.zero.construction import ConstructionRecord, holders_of
from meshzero.zero.draws import ReplayDraws


def _creator(param: torch.Tensor) -> tuple[nn.Module, ConstructionRecord] | None:
    holders = holders_of(param)
    if not holders:
        return None
    record = holders[0][2]
    creator = record.creator_of(param)
    module = next((m for m, _, _ in holders if id(m) == creator), holders[0][0])
    return module, record


def _make_real(module: nn.Module, record: ConstructionRecord
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Materialise ``module``'s own meta parameters and buffers with its init replayed;
    returns (meta, real) of each, the real ones now in every module holding them."""
    made = []
    for kind in ("_parameters", "_buffers"):
        for name, meta in list(getattr(module, kind).items()):
            if meta is None or not meta.is_meta:
                continue
            data = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
            if data.is_floating_point():
                data.fill_(math.nan)
            real = nn.Parameter(data, requires_grad=meta.requires_grad) \
                if kind == "_parameters" else data
            made.append((kind, name, meta, real))
            getattr(module, kind)[name] = real
    targets = [(real, record.draws.of(meta)) for _, _, meta, real in made]
    with torch.no_grad(), ReplayDraws(targets):
        if record.init_fn is not None:
            record.init_fn(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        elif made:
            raise ValueError(
                f"a gathered block needs {type(module).__name__}'s parameters before "
                "initialize, but it has no reset_parameters() to initialise them from the "
                "meta device: give it one, or pass zero_init(init_fn=...)")
    for kind, _, meta, real in made:
        if kind == "_parameters":
            for holder, hname, _ in holders_of(meta):
                holder._parameters[hname] = real  # type: ignore[assignment]  # a Parameter
    return [(meta, real) for _, _, meta, real in made]


def _put_back(made: list[tuple[torch.Tensor, torch.Tensor]],
              modules: list[nn.Module]) -> None:
    for meta, real in made:
        for holder, name, _ in holders_of(real):
            holder._parameters[name] = meta  # type: ignore[assignment]  # a Parameter
        for module in modules:
            for name, b in module._buffers.items():
                if b is real:
                    module._buffers[name] = meta


@contextmanager
def gathered_meta(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Make ``params`` (meta, built under ``zero_init``) real inside the block; keep rank
    ``modifier_rank``'s values on exit, or put the meta parameters back (None)."""
    modules: list[tuple[nn.Module, ConstructionRecord]] = []
    for p in params:
        found = _creator(p)
        if found is None:
            raise ValueError(f"a meta parameter of shape {tuple(p.shape)} was not built under "
                             "meshzero.zero_init (or its module was dropped): nothing can "
                             "give it values before initialize")
        if all(found[0] is not m for m, _ in modules):
            modules.append(found)
    made = [pair for m, record in modules for pair in _make_real(m, record)]
    try:
        yield
    except BaseException:
        _put_back(made, [m for m, _ in modules])
        raise
    if modifier_rank is None:
        _put_back(made, [m for m, _ in modules])
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        with torch.no_grad():
            for _, real in made:
                moved = real.detach().to(device)
                dist.broadcast(moved, src=modifier_rank)
                real.detach().copy_(moved)
    for m, record in modules:
        record.early_modules.add(m)
        for kind in ("_parameters", "_buffers"):
            for t in getattr(m, kind).values():
                if t is not None:
                    record.early_params.add(t)

"""Offload the engine's states to host memory between phases, and reload them.

RLHF frees the accelerator of a trainer's optimizer side while another model generates
(DeepSpeed's ``engine.offload_states()`` / ``reload_states()``). What can move, by
DeepSpeed's names (``OffloadStateTypeEnum``) and the ``memory_report()`` category they are:

    optim_states            optimizer_states   every tensor of the optimizer's state
    hp_params               master_params      the fp32 master, where it is a copy (in fp32
                                               training the master *is* the parameters: it
                                               moves with lp_params)
    lp_params               params             the stage-3 shards, the full buffers at 0-2
    lp_grads                grads              the gradient shard (and the accumulation
                                               buffer at stages 0-1)
    contiguous_grad_buffer  (none at rest)     the reducer's transient buffers: freed at the
                                               end of every backward, nothing to move

A tensor moves by copying it into a host buffer (page-locked on CUDA with ``pin_memory``)
and freeing its storage; every view of it (the optimizer's fragment leaves, the module's
parameters, gradient views) stays the same object and sees the values again once
:meth:`StateOffload.reload` reallocates the storage and copies them back. Only what
``memory_report()`` places on the device moves: what an offload tier keeps in host memory
or files already (``offload_optimizer``) is left where it is, with one INFO line;
``offload_param`` is refused, as DeepSpeed refuses it. On a CPU-only machine the device is
the CPU: the copy is still a separate host buffer and the original storage is freed, so
``memory_report()`` moves the bytes from ``device`` to ``host`` exactly as on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from meshzero.zero.flat_buffer import alloc_storage, free_storage

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup

logger = logging.getLogger(__name__)

# DeepSpeed's OffloadStateTypeEnum values -> the memory_report category each one is
STATES = {"optim_states": "optimizer_states", "hp_params": "master_params",
          "lp_params": "params", "lp_grads": "grads", "contiguous_grad_buffer": None}
# what each engine call reads (a call with any of these offloaded is refused)
NEEDS = {"forward": ("lp_params",), "backward": ("lp_params", "lp_grads"),
         "step": ("optim_states", "hp_params", "lp_params", "lp_grads"),
         "checkpoint": ("optim_states", "hp_params", "lp_params", "lp_grads")}


def state_names(include: Iterable[Any] | None) -> list[str]:
    """``include`` (DeepSpeed's enum members or their string values; None: all) as names,
    checked before anything moves."""
    if include is None:
        return list(STATES)
    if isinstance(include, str):
        include = [include]
    names = []
    for item in include:
        name = getattr(item, "value", item)
        if name not in STATES:
            raise ValueError(f"offload_states include: {item!r} is not a state; valid: "
                             f"{', '.join(STATES)}")
        names.append(name)
    return names


class _Moved:
    """One tensor in host memory: its storage on the device is freed until reload."""

    def __init__(self, tensor: torch.Tensor, pin: bool, non_blocking: bool) -> None:
        assert tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes(), \
            "only a tensor that is its whole storage can move (views of it stay valid)"
        self.tensor = tensor
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        self.host.copy_(tensor.detach(), non_blocking=non_blocking)
        free_storage(tensor)

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def reload(self, non_blocking: bool) -> None:
        alloc_storage(self.tensor)
        with torch.no_grad():
            self.tensor.copy_(self.host, non_blocking=non_blocking)


class StateOffload:
    """Which states of one rank are in host memory now, and the bytes each category moved."""

    def __init__(self, device: torch.device, tier_name: str, param_offload: str) -> None:
        self.device = device
        self.tier_name = tier_name  # where master, gradient shard and states live
        self.param_offload = param_offload  # offload_param.device
        self.moved: dict[str, list[_Moved]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.moved)

    def check(self, call: str) -> None:
        """Refuse ``call`` (forward, backward, step, checkpoint) if it reads a state that is
        in host memory now."""
        away = [n for n in NEEDS[call] if n in self.moved]
        if away:
            raise RuntimeError(f"{call} needs {', '.join(away)}, offloaded by "
                               "engine.offload_states(): call engine.reload_states() first")

    def offload(self, names: list[str], groups: list[FlatGroup],
                optimizer: torch.optim.Optimizer | None, *, pin_memory: bool,
                non_blocking: bool) -> None:
        if self.param_offload != "none" and "lp_params" in names:
            raise ValueError("offload_states cannot move parameters that offload_param "
                             f"({self.param_offload}) places already (DeepSpeed refuses it "
                             "too): leave 'lp_params' out of include")
        pin = pin_memory and self.device.type == "cuda"  # page-locked only helps a GPU
        kept = [n for n in names if n in ("optim_states", "hp_params", "lp_grads")
                and self.tier_name != "device"]
        if kept:
            logger.info("offload_states: %s stay where offload_optimizer keeps them (%s): "
                        "not moved", ", ".join(kept), self.tier_name)
        for name in names:
            if name in self.moved or name in kept:
                continue  # in host memory already (DeepSpeed skips those too)
            tensors = _tensors(name, groups, optimizer)
            self.moved[name] = [_Moved(t, pin, non_blocking) for t in tensors]
        if not non_blocking and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reload(self, non_blocking: bool) -> None:
        for moved in self.moved.values():
            for m in moved:
                m.reload(non_blocking)
        self.moved.clear()  # the host copies go with them
        if not non_blocking and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def adjust(self, report: dict) -> None:
        """``memory_report()``'s bytes of the moved tensors: from the device to host."""
        for name, moved in self.moved.items():
            category = STATES[name]
            if category is None:
                continue
            nbytes = sum(m.nbytes for m in moved)
            report[category]["device"] -= nbytes
            report[category]["host"] += nbytes


def _tensors(name: str, groups: list[FlatGroup], optimizer: torch.optim.Optimizer | None
             ) -> list[torch.Tensor]:
    """The distinct tensors (one per storage) of state ``name`` that live on the device, as
    memory_report() counts them."""
    out: list[torch.Tensor] = []
    if name == "optim_states" and optimizer is not None:
        out = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    for g in groups:
        if name == "hp_params" and g.trainable and g.master_is_copy:
            assert g.master is not None  # a trainable group holds its master
            out.append(g.master)
        elif name == "lp_params":
            out.append(g.shard if g.sharded else g.full)
        elif name == "lp_grads" and g.trainable:
            if g.stage <= 1:
                assert g.grad_full is not None  # persistent at stages 0-1
                out.append(g.grad_full)  # the gradient shard is a view of it
            elif g.grad is not None:
                out.append(g.grad)
    seen: set[int] = set()
    unique = []
    for t in out:
        key = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() and key not in seen:
            seen.add(key)
            unique.append(t)
    return unique

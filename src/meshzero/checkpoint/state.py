"""What a checkpoint holds besides parameter values, captured from and restored into a live
run: optimizer state per fragment, optimizer hyperparameters, scheduler, RNG states, and
the model's names (canonical parameters, tied aliases, buffers).

Optimizer state is stored per fragment and keyed by parameter name and element range (see
format.py), so it reshards like the parameters: a tensor shaped like the fragment is cut
by element ("element" state: Adam's exp_avg, exp_avg_sq); a 0-dim tensor ("scalar" state:
Adam's step) is stored once per fragment and read back from any piece that overlaps.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from meshzero.checkpoint.format import (
    CheckpointReader,
    TensorSpec,
    check_json,
    dtype_name,
    piece_key,
)
from meshzero.checkpoint.training import TrainingState
from meshzero.log import warn_once

try:  # numpy is a declared dependency; the guard keeps a broken install loadable
    import numpy

    np: ModuleType | None = numpy
except ImportError:  # pragma: no cover
    np = None

logger = logging.getLogger(__name__)

Item = tuple[TensorSpec, torch.Tensor]


@dataclass
class ModelNames:
    """Names of ``model.state_dict()``: canonical parameters (``Layout.slots`` keys), tied
    aliases of them, and buffers, in state_dict order."""

    aliases: dict[str, str]  # alias -> canonical parameter name
    buffers: dict[str, torch.Tensor]
    order: list[str]

    def aliases_of(self, canonical: str) -> list[str]:
        return [a for a, c in self.aliases.items() if c == canonical]


def model_names(state: TrainingState) -> ModelNames:
    canonical = {id(p): name for name, p in state.module.named_parameters()}
    aliases, buffers, order = {}, {}, []
    for name, t in state.module.state_dict(keep_vars=True).items():
        order.append(name)
        if id(t) not in canonical:
            buffers[name] = t
        elif canonical[id(t)] != name:
            aliases[name] = canonical[id(t)]
    for name in order:
        if "|" in name:
            raise ValueError(f"state_dict name {name!r} contains '|', which checkpoint keys "
                             "use as a separator")
    return ModelNames(aliases, buffers, order)


def qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- optimizer -------------------------------------------------------------------------------
def optimizer_metadata(state: TrainingState) -> dict:
    """Class and per-group hyperparameters (JSON-able ones; others are skipped with a warning)."""
    groups: list[dict] = []
    if state.optimizer is None:  # an engine without an optimizer (forward only)
        return {"class": None, "param_groups": groups}
    for i, group in enumerate(state.optimizer.param_groups):
        kept = {}
        for key, value in group.items():
            if key == "params":
                continue
            if _jsonable(value):
                kept[key] = value
            else:
                warn_once(logger, f"optimizer param_groups[{i}][{key!r}] is not JSON-serialisable"
                                  " and is not saved in checkpoints")
        groups.append(kept)
    return {"class": qualname(state.optimizer), "param_groups": groups}


def optimizer_items(state: TrainingState, info: dict) -> list[Item]:
    """This rank's optimizer state tensors as checkpoint items; group membership, state kinds
    and non-tensor state go into ``info`` (merged over ranks into the manifest)."""
    opt = state.optimizer
    if opt is None:  # forward only: no fragments, no state
        return []
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    kinds, members, extra = info["state_kinds"], info["param_group_of"], info["extra_state"]
    items: list[Item] = []
    for leaf, frag, _ in state.zero.optim_state.fragment_index:
        name = frag.slot.name
        members[name] = group_of[id(leaf)]
        for kind, value in opt.state.get(leaf, {}).items():
            if not isinstance(value, torch.Tensor):
                check_json(value, f"optimizer state {kind!r} of {name}")
                extra.setdefault(name, {})[kind] = value
                continue
            if value.shape == leaf.shape:
                kinds[kind] = "element"
            elif value.dim() == 0:
                kinds[kind] = "scalar"
            else:
                raise ValueError(f"optimizer state {kind!r} of {name} has shape "
                                 f"{tuple(value.shape)}, neither the fragment's "
                                 f"{tuple(leaf.shape)} nor a scalar: it cannot be resharded")
            key = piece_key(name, frag.start, frag.end, f"optim.{kind}")
            items.append((TensorSpec(key, value.dtype, tuple(value.shape)), value))
    return items


def check_optimizer(state: TrainingState, saved: dict, rename: dict[str, str]) -> None:
    """ValueError if the saved optimizer state cannot go into this engine's optimizer."""
    opt = state.optimizer
    assert opt is not None  # without one no optimizer state is loaded (load_checkpoint)
    if saved["class"] != qualname(opt):
        raise ValueError(f"the checkpoint's optimizer is {saved['class']}, this engine's is "
                         f"{qualname(opt)}; pass load_optimizer_states=False to load only "
                         "the model")
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param "
                         f"groups, this engine's has {len(opt.param_groups)}")
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    for leaf, frag, _ in state.zero.optim_state.fragment_index:
        if frag.slot.name not in rename:  # not in the checkpoint (strict=False): fresh state
            continue
        want = saved["param_group_of"].get(rename[frag.slot.name])
        if want is not None and want != group_of[id(leaf)]:
            raise ValueError(f"parameter {frag.slot.name} is in param group "
                             f"{group_of[id(leaf)]} but was saved in group {want}")


def load_optimizer(state: TrainingState, reader: CheckpointReader, saved: dict,
                   rename: dict[str, str]) -> None:
    """Hyperparameters per group, then the state of every fragment (read by element range)."""
    opt = state.optimizer
    assert opt is not None  # without one no optimizer state is loaded (load_checkpoint)
    for group, hyper in zip(opt.param_groups, saved["param_groups"], strict=True):
        for key, value in hyper.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    opt.state.clear()
    for leaf, frag, _ in state.zero.optim_state.fragment_index:
        if frag.slot.name not in rename:  # not in the checkpoint (strict=False): fresh state
            continue
        name = rename[frag.slot.name]
        pg = group_of[id(leaf)]
        # torch keeps Adam's step on the CPU unless the kernels are fused or capturable
        scalar_device = leaf.device if pg.get("fused") or pg.get("capturable") else "cpu"
        values: dict[str, Any] = {}
        for kind, how in saved["state_kinds"].items():
            key = f"optim.{kind}"
            if not reader.has(name, key):
                continue
            if how == "element":
                values[kind] = reader.read(name, key, frag.start, frag.end).to(leaf.device)
            else:
                values[kind] = reader.read_scalar(name, key, frag.start, frag.end).to(
                    scalar_device)
        values.update(saved["extra_state"].get(name, {}))
        if values:
            opt.state[leaf] = values
    loaded = getattr(opt, "state_loaded", None)  # an optimizer whose mode follows its state
    if callable(loaded):
        loaded()


def optimizer_files(state: TrainingState, reader: CheckpointReader, saved: dict,
                    rename: dict[str, str]) -> set[int]:
    files = set()
    for _, frag, _ in state.zero.optim_state.fragment_index:
        if frag.slot.name not in rename:
            continue
        name = rename[frag.slot.name]
        for kind in saved["state_kinds"]:
            if reader.has(name, f"optim.{kind}"):
                end = max(frag.end, frag.start + 1)
                files |= {p.file for p in reader.locate(name, f"optim.{kind}", frag.start, end)}
    return files


# -- scheduler -------------------------------------------------------------------------------
def scheduler_metadata(state: TrainingState) -> dict | None:
    sched = state.lr_scheduler
    if sched is None:
        return None
    values = sched.state_dict()
    check_json(values, f"the state_dict of lr scheduler {qualname(sched)}")
    return {"class": qualname(sched), "state": values}


def check_scheduler(state: TrainingState, saved: dict | None) -> None:
    sched = state.lr_scheduler
    if sched is not None and saved is not None and saved["class"] != qualname(sched):
        raise ValueError(f"the checkpoint's lr scheduler is {saved['class']}, this engine's is "
                         f"{qualname(sched)}; pass load_lr_scheduler_states=False")


def load_scheduler(state: TrainingState, saved: dict | None, *, set_lr: bool) -> None:
    """Restore the scheduler; ``set_lr`` also puts its last lr into the param groups (when
    the optimizer's own hyperparameters were not loaded)."""
    sched = state.lr_scheduler
    if sched is None or saved is None:
        if (sched is None) != (saved is None):
            warn_once(logger, "lr scheduler state not loaded: the checkpoint has "
                              f"{'one' if saved else 'none'}, this engine has "
                              f"{'one' if sched else 'none'}")
        return
    sched.load_state_dict(saved["state"])
    if set_lr and state.optimizer is not None:  # a scheduler comes with an optimizer
        for group, lr in zip(state.optimizer.param_groups, sched.get_last_lr(), strict=False):
            group["lr"] = lr


# -- RNG -------------------------------------------------------------------------------------
def rng_items(rank: int, info: dict) -> list[Item]:
    """Torch RNG states as uint8 tensors; Python's and numpy's into ``info`` (JSON)."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    info["rng"] = {"python": [version, list(internal), gauss]}
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        info["rng"]["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return [(TensorSpec(f"rng|{rank}|{source}", torch.uint8, tuple(t.shape)), t)
            for source, t in states.items()]


def rng_files(reader: CheckpointReader, rank: int) -> set[int]:
    key = f"rng|{rank}|torch_cpu"
    return {reader.whole[key]} if key in reader.whole else set()


def load_rng(reader: CheckpointReader, saved: dict, rank: int) -> None:
    """This rank's RNG states, if the saving run had a rank with this index."""
    if str(rank) not in saved:
        warn_once(logger, f"the checkpoint has no RNG state for rank {rank} (saved with "
                          f"{len(saved)} ranks); this rank keeps its current RNG state")
        return
    states = saved[str(rank)]
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if np is not None and "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(reader.read_whole(f"rng|{rank}|torch_cpu"))
    cuda_key = f"rng|{rank}|torch_cuda"
    if cuda_key in reader.whole and torch.cuda.is_available():
        torch.cuda.set_rng_state(reader.read_whole(cuda_key))


# -- names -----------------------------------------------------------------------------------
def model_metadata(state: TrainingState, names: ModelNames,
                   skip: frozenset[str] = frozenset()) -> dict:
    """Parameter names, shapes and dtypes, aliases, buffers and the unit layout; the
    parameters in ``skip`` (and their tied aliases) are left out of params and state_dict."""
    params = {}
    for group in state.zero.groups:
        for slot, p in zip(group.layout.slots, group.params, strict=True):
            if slot.name in skip:
                continue
            params[slot.name] = {"shape": list(slot.shape), "dtype": dtype_name(p.dtype),
                                 "requires_grad": group.trainable, "unit": slot.unit,
                                 "group": slot.group}
    buffers = {name: {"shape": list(b.shape), "dtype": dtype_name(_saved_dtype(b))}
               for name, b in names.buffers.items()}
    layout = state.zero.layout
    units = [{"path": u.path, "groups": [
        {"requires_grad": g.requires_grad, "persistent": g.persistent, "numel": g.numel,
         "padded_numel": g.padded_numel, "shard_numel": g.shard_numel,
         "slots": [[s.name, s.offset, s.numel] for s in g.slots]} for g in u.groups]}
        for u in layout.units]
    aliases = {a: c for a, c in names.aliases.items() if c not in skip}
    order = [n for n in names.order if n not in skip and names.aliases.get(n) not in skip]
    return {"params": params, "aliases": aliases, "buffers": buffers,
            "state_dict": order, "layout": {"num_shards": layout.num_shards,
                                                  "units": units}}


def _saved_dtype(t: torch.Tensor) -> torch.dtype:
    """Floating buffers are saved in fp32 (exact for 16-bit ones), others as they are."""
    return torch.float32 if t.is_floating_point() else t.dtype


def buffer_items(names: ModelNames) -> list[Item]:
    return [(TensorSpec(f"{name}|buffer", _saved_dtype(b), tuple(b.shape)), b)
            for name, b in names.buffers.items()]


def match_names(names: ModelNames, state: TrainingState, manifest: dict, where: str,
                strict: bool = True) -> dict[str, str]:
    """``{model canonical param: checkpoint canonical param}`` of the parameters the
    checkpoint holds. ValueError listing missing and unexpected names and shape mismatches;
    with ``strict=False`` (torch's ``load_state_dict(strict=False)``) only shape mismatches
    raise, and one INFO line names what stays as it is and what is ignored. Frozen
    parameters a save excluded (``excluded_parameters``) are never missing: the model keeps
    its own values, as DeepSpeed's load of such a checkpoint does."""
    saved_order = set(manifest["state_dict"])
    excluded = set(manifest.get("excluded_parameters", ()))
    frozen = {s.name for g in state.zero.groups if not g.trainable for s in g.layout.slots}
    kept = {n for n in names.order if names.aliases.get(n, n) in excluded & frozen}
    missing = [n for n in names.order if n not in saved_order and n not in kept]
    unexpected = [n for n in manifest["state_dict"] if n not in set(names.order)]
    rename, mismatched = {}, []
    for name, slot in state.zero.layout.slots.items():
        src = manifest["aliases"].get(name, name)
        if src in manifest["params"]:
            rename[name] = src
            if tuple(manifest["params"][src]["shape"]) != slot.shape:
                mismatched.append(f"{name}: checkpoint {tuple(manifest['params'][src]['shape'])}"
                                  f", model {slot.shape}")
    for name, buf in names.buffers.items():
        info = manifest["buffers"].get(name)
        if info is not None and tuple(info["shape"]) != tuple(buf.shape):
            mismatched.append(f"{name}: checkpoint {tuple(info['shape'])}, model "
                              f"{tuple(buf.shape)}")
    if mismatched or (strict and (missing or unexpected)):
        raise ValueError(f"checkpoint {where} does not match the model:\n"
                         f"  missing (in the model, not in the checkpoint): {missing}\n"
                         f"  unexpected (in the checkpoint, not in the model): {unexpected}\n"
                         f"  shape mismatches: {mismatched}")
    if missing or unexpected:
        logger.info("load_module_strict=False: %d missing key(s) keep the model's own values "
                    "%s; %d unexpected key(s) in the checkpoint are ignored %s", len(missing),
                    missing, len(unexpected), unexpected)
    return rename

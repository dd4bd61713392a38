"""``save_pretrained`` of a sharded engine's model: the files ``from_pretrained`` reads.

    a PEFT model     its adapters, as ``PeftModel.save_pretrained`` writes them
                     (``adapter_config.json`` + ``adapter_model.safetensors``): the tensors
                     peft's own ``get_peft_model_state_dict`` picks, gathered in full (only
                     those, one stage-3 unit at a time), handed to the PeftModel's
                     ``save_pretrained`` on world rank 0
    any other model  ``model.safetensors`` or shards with ``model.safetensors.index.json``
                     above ``max_shard_size`` (Hugging Face's names and layout, tied aliases
                     dropped as transformers drops them), config.json, generation_config.json,
                     gathered unit by unit (checkpoint/pretrained.py)

Both are collective (every rank calls them) and write whatever
``stage3_gather_16bit_weights_on_model_save`` says: where DeepSpeed (and the Trainer on it)
would write a ZeRO checkpoint that needs zero_to_fp32, the loadable files are written and one
INFO line says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import meshzero
from meshzero.checkpoint.model_files import parse_size
from meshzero.checkpoint.pretrained import save_pretrained_weights

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (peft is imported only if it is loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def save_pretrained(engine: meshzero.Engine, save_directory: str | os.PathLike, *,
                    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                    **peft_kwargs: Any) -> list[str] | None:
    """Write ``engine.module`` into ``save_directory`` as ``from_pretrained`` (or
    ``PeftModel.from_pretrained``) reads it; collective. ``peft_kwargs`` go to the PeftModel's
    ``save_pretrained`` (``selected_adapters``, ``save_embedding_layers``). Returns the file
    names on world rank 0, else None."""
    max_bytes = parse_size(max_shard_size)
    _say_when_deepspeed_would_not(engine)
    if is_peft_model(engine.module):
        return save_adapter(engine, save_directory, **peft_kwargs)
    if peft_kwargs:
        raise ValueError(f"save_pretrained: {sorted(peft_kwargs)} apply to PEFT models only; "
                         f"{type(engine.module).__name__} is not one")
    with engine.zero.phases.entry("save_16bit_model"), engine.zero.materialized():
        return save_pretrained_weights(engine.training_state(), save_directory,
                                       max_shard_bytes=max_bytes,
                                       drop=tied_names_dropped_on_save(engine.module))


def _say_when_deepspeed_would_not(engine: meshzero.Engine) -> None:
    zero = engine.config.zero_optimization
    if engine.zero_stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        logger.info("save_pretrained: stage3_gather_16bit_weights_on_model_save is %s; "
                    "DeepSpeed would write a ZeRO checkpoint here (from_pretrained needs "
                    "zero_to_fp32 first); meshzero writes the from_pretrained files, "
                    "gathered unit by unit", zero.stage3_gather_16bit_weights_on_model_save)


def tied_names_dropped_on_save(module: nn.Module) -> frozenset[str]:
    """The state_dict names of tied parameters that transformers' ``save_pretrained`` leaves
    out (it keeps one name per tied tensor); empty for a module transformers does not own."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        return frozenset()
    if not callable(getattr(module, "get_parameter_or_buffer", None)):
        return frozenset()
    # one distinct 1-element tensor per parameter object: aliases share it, as in the model
    stand_in: dict[int, torch.Tensor] = {}
    named = {name: stand_in.setdefault(id(t), torch.empty(1))
             for name, t in module.state_dict(keep_vars=True).items()}
    kept = remove_tied_weights_from_state_dict(dict(named), module)  # type: ignore[arg-type]
    return frozenset(named) - frozenset(kept)


def adapter_names(module: Any, selected_adapters: list[str] | None = None,
                  save_embedding_layers: Any = "auto") -> list[str]:
    """The names in ``module.state_dict()`` that peft's ``get_peft_model_state_dict`` saves
    for each adapter: found by handing it a stand-in state dict and seeing which it picks."""
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError as e:  # a PEFT model's save without peft importable: an extra
        raise ImportError("saving a PEFT adapter needs peft: pip install 'meshzero[trl]'") from e

    stand_in = {name: torch.empty(0) for name in module.state_dict(keep_vars=True)}
    by_id = {id(t): name for name, t in stand_in.items()}
    picked: dict[str, None] = {}
    for adapter in selected_adapters or list(module.peft_config):
        chosen = get_peft_model_state_dict(module, state_dict=stand_in, adapter_name=adapter,
                                           save_embedding_layers=save_embedding_layers)
        for value in chosen.values():
            if id(value) not in by_id:
                raise RuntimeError("peft's get_peft_model_state_dict returned a tensor that "
                                   "is not one of the state dict's: this peft release is not "
                                   "supported by meshzero.hf.save_adapter")
            picked[by_id[id(value)]] = None
    return list(picked)


def _by_unit(engine: meshzero.Engine, names: list[str], tensors: dict[str, Any]
             ) -> list[list[str]]:
    """``names`` grouped by the stage-3 unit holding them (one group at stages 0-2), in the
    same order on every rank: gathering one group holds one unit, not the model."""
    staged = engine.zero.sharder is not None  # stage 3: units are gathered one by one
    groups: dict[int, list[str]] = {}
    for name in names:
        held = engine.zero.slot_of(tensors[name]) if staged else None  # (group, slot)
        groups.setdefault(held[0].layout.unit if held else -1, []).append(name)
    return [groups[u] for u in sorted(groups)]


def save_adapter(engine: meshzero.Engine, save_directory: str | os.PathLike,
                 **peft_kwargs: Any) -> list[str] | None:
    """The PEFT adapters of ``engine.module``, gathered in full, saved by the PeftModel's own
    ``save_pretrained`` on world rank 0; collective."""
    module: Any = engine.module  # a peft.PeftModel
    names = adapter_names(module, peft_kwargs.get("selected_adapters"),
                          peft_kwargs.get("save_embedding_layers", "auto"))
    tensors = module.state_dict(keep_vars=True)
    full: dict[str, torch.Tensor] = {}
    with engine.zero.phases.entry("save_16bit_model"), torch.no_grad():
        for unit_names in _by_unit(engine, names, tensors):  # one stage-3 unit at a time
            wanted = [tensors[n] for n in unit_names]
            with engine.gathered([t for t in wanted if isinstance(t, nn.Parameter)]):
                full.update({n: t.detach().to("cpu", copy=True)
                             for n, t in zip(unit_names, wanted, strict=True)})
    full = {n: full[n] for n in names}
    if engine.topology.rank != 0:
        return None
    module.save_pretrained(str(save_directory), state_dict=full, safe_serialization=True,
                           **peft_kwargs)
    written = sorted(p.name for p in Path(save_directory).iterdir())
    logger.info("saved the PEFT adapter(s) of %d tensor(s) to %s: %s", len(full),
                save_directory, ", ".join(written))
    return written

"""A live engine's model as a Hugging Face ``save_pretrained`` directory, written unit by unit.

``model.safetensors``, or, above ``max_shard_bytes``, ``model-0000i-of-0000N.safetensors``
with ``model.safetensors.index.json`` (Hugging Face's names and layout, checkpoint/
model_files.py), plus config.json and generation_config.json. Collective: each ZeRO group
(a unit at stage 3) is gathered in turn and streamed to world rank 0, which writes one tensor
at a time; no rank ever holds the whole model. Tied aliases that Hugging Face drops on save
(``drop``) are left out, as ``save_pretrained`` does; ``from_pretrained`` ties them again.

Used by :mod:`meshzero.hf.save` for ``Trainer.save_model`` / ``save_pretrained``. Meshzero's
own ``save_16bit_model`` (one file, every alias) is checkpoint/weights.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from meshzero.checkpoint.atomic import commit_files, discard_temps, prepare_dir, write_temp_bytes
from meshzero.checkpoint.export import full_shape
from meshzero.checkpoint.format import TensorSpec
from meshzero.checkpoint.mesh import on_all_ranks
from meshzero.checkpoint.model_files import (
    INDEX_SUFFIX,
    WEIGHTS_NAME,
    model_file_set,
    plan_shards,
    shard_file_names,
    write_model_temps,
)
from meshzero.checkpoint.state import model_names
from meshzero.checkpoint.training import TrainingState
from meshzero.checkpoint.weights import shard_layouts
from meshzero.hf.files import hf_model_files, render_hf_model_files
from meshzero.parallel.tensor_state import gather_tp_tensor

logger = logging.getLogger(__name__)


def _plan(state: TrainingState, drop: frozenset[str]) -> tuple[list[TensorSpec], list]:
    """The tensors to write, in order, and for each group its slots' output names."""
    names = model_names(state)
    layouts = shard_layouts(state)
    dtype = state.compute_dtype
    specs: list[TensorSpec] = []
    plan = []
    for group in state.zero.groups:
        slots = []
        for slot in group.layout.slots:
            shape = full_shape(slot.shape, layouts.get(slot.name), state.topology.tp_size)
            out = [n for n in [slot.name, *names.aliases_of(slot.name)] if n not in drop]
            specs += [TensorSpec(n, dtype, shape) for n in out]
            slots.append((slot, out))
        plan.append((group, slots))
    for name, buf in names.buffers.items():
        if name not in drop:
            specs.append(TensorSpec(name, dtype if buf.is_floating_point() else buf.dtype,
                                    tuple(buf.shape)))
    return specs, plan


def save_pretrained_weights(state: TrainingState, save_dir: str | os.PathLike, *,
                            max_shard_bytes: int | None = None,
                            drop: frozenset[str] = frozenset()) -> list[str] | None:
    """Write the model of ``state`` into ``save_dir`` as ``from_pretrained`` reads it (see the
    module docstring); collective. Returns the files written on world rank 0, else None."""
    t = state.topology
    if t.pp_size > 1:
        raise ValueError("save_pretrained_weights: pipeline_parallel.size > 1 splits the model "
                         "across ranks; use engine.save_16bit_model (one file per stage)")
    layouts = shard_layouts(state)
    specs, plan = _plan(state, drop)
    names = model_names(state)
    dtype = state.compute_dtype

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for group, slots in plan:
            flat = state.zero.full_fp32(group)  # collective at stages 1-3: one group at a time
            for slot, out in slots:
                value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                if slot.name in layouts:  # collective over tp
                    value = gather_tp_tensor(value.to(state.device), layouts[slot.name],
                                             t.groups["tp"]).cpu()
                for name in out:
                    yield name, value.to(dtype)
            del flat
        for name, buf in names.buffers.items():
            if name not in drop:
                yield name, buf.detach().to(dtype if buf.is_floating_point() else buf.dtype)

    save_dir = Path(save_dir)
    stream = gathered()
    first = t.rank == 0
    count = len(plan_shards(specs, max_shard_bytes))
    written = shard_file_names(WEIGHTS_NAME, count) + ([WEIGHTS_NAME + INDEX_SUFFIX]
                                                       if count > 1 else [])

    def write() -> None:
        try:
            if first:
                write_model_temps(save_dir, specs, stream, max_shard_bytes=max_shard_bytes)
        finally:
            for _ in stream:  # keep taking part in the gathers, whatever happened here
                pass

    on_all_ranks(state, "save_pretrained prepare", lambda: prepare_dir(save_dir) if first
                 else None)
    try:
        on_all_ranks(state, "save_pretrained", write)
        on_all_ranks(state, "save_pretrained commit",
                     lambda: _commit(state, save_dir, written) if first else None)
    except Exception:
        if first:
            discard_temps(save_dir, written)
        raise
    return written if first else None


def _commit(state: TrainingState, save_dir: Path, written: list[str]) -> None:
    extra = render_hf_model_files(hf_model_files(state.module), state.compute_dtype)
    for name, data in extra.items():
        write_temp_bytes(save_dir, name, data)
    written.extend(extra)
    stale = [n for n in model_file_set(save_dir) if n not in written]
    commit_files(save_dir, written, stale)
    logger.info("saved the model to %s (%s), gathered unit by unit", save_dir,
                ", ".join(n for n in written if n.startswith("model")))

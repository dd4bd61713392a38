"""Whole-model weight files: a checkpoint consolidated into one model file, a live engine's
model in the compute dtype, and pretrained weights loaded into a sharded engine; on any mesh
(tp slices are put together or cut, pipeline stages side by side).

    consolidate       checkpoint -> model.safetensors (or shards + index), one CPU process
    save_16bit_model  live engine -> model.safetensors in the compute dtype (one writer per
                      pipeline stage; with pp > 1 one file per stage and an index)
    load_weights      model.safetensors (or index) -> the sharded state, each rank reading
                      only its fragments (a tp-sharded parameter: read whole, then cut)
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from meshzero.checkpoint.atomic import (
    commit_files,
    discard_temps,
    finish_journal,
    prepare_dir,
    temp_path,
    write_temp_bytes,
)
from meshzero.checkpoint.export import full_shape
from meshzero.checkpoint.format import (
    TensorSpec,
)
from meshzero.checkpoint.mesh import on_all_ranks, tensor_parallel_layouts
from meshzero.checkpoint.model_files import (
    INDEX_SUFFIX,
    WeightsReader,
    check_filename,
    model_file_set,
    shard_file_names,
    write_index,
    write_model_temps,
)
from meshzero.checkpoint.state import ModelNames, model_names
from meshzero.checkpoint.training import TrainingState
from meshzero.hf.files import hf_model_files, render_hf_model_files
from meshzero.parallel.shards import ShardLayout, shard_tensor
from meshzero.parallel.tensor_state import gather_tp_tensor
from meshzero.zero.fragment_views import fragment_views

logger = logging.getLogger(__name__)

def full_model_tensors(state: TrainingState, skip: frozenset[str] = frozenset()
                       ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
    """The full model in the compute dtype under the model's own names (tied ones under
    each name, buffers last): the specs, and a stream of ``(name, CPU tensor)`` that is a
    collective (each ZeRO group is gathered in turn, tp slices all-gathered): every rank
    must exhaust it. The parameters in ``skip`` (and their aliases) are left out, their
    groups still gathered."""
    names = model_names(state)
    dtype = state.compute_dtype
    t = state.topology
    layouts = shard_layouts(state)
    specs = []
    for group in state.zero.groups:
        for slot in group.layout.slots:
            if slot.name in skip:
                continue
            shape = full_shape(slot.shape, layouts.get(slot.name), t.tp_size)
            for name in [slot.name, *names.aliases_of(slot.name)]:
                specs.append(TensorSpec(name, dtype, shape))
    out_dtype = {n: dtype if b.is_floating_point() else b.dtype for n, b in names.buffers.items()}
    specs += [TensorSpec(n, out_dtype[n], tuple(b.shape)) for n, b in names.buffers.items()]

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for group in state.zero.groups:
            flat = state.zero.full_fp32(group)  # collective at stages 1-3
            for slot in group.layout.slots:
                value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                if slot.name in layouts:  # collective over tp
                    value = gather_tp_tensor(value.to(state.device), layouts[slot.name],
                                             t.groups["tp"]).cpu()
                if slot.name in skip:
                    continue
                value = value.to(dtype, copy=True)  # its own storage, not a view of flat
                for name in [slot.name, *names.aliases_of(slot.name)]:
                    yield name, value
        for name, buf in names.buffers.items():
            yield name, buf.detach().to("cpu", out_dtype[name], copy=True)

    return specs, gathered()


def consolidated_state_dict(state: TrainingState, skip: frozenset[str] = frozenset()
                            ) -> dict[str, torch.Tensor]:
    """``{name: full CPU tensor in the compute dtype}`` in ``model.state_dict()`` order on
    world rank 0 (tied names share one tensor), ``{}`` on the others; collective. The
    parameters in ``skip`` are left out. With pipeline parallelism each stage holds only its
    own layers: save_16bit_model writes them, one file per stage."""
    if state.topology.pp_size > 1:
        raise ValueError("consolidated_16bit_state_dict needs the whole model on one rank; "
                         "with pipeline_parallel.size > 1 use save_16bit_model (one file per "
                         "stage) or consolidate a checkpoint")
    order = model_names(state).order
    first = state.topology.rank == 0
    _, stream = full_model_tensors(state, skip)
    values = {}
    for name, value in stream:  # every rank takes part in every gather
        if first:
            values[name] = value
    return {name: values[name] for name in order if name in values}


def save_16bit_model(state: TrainingState, save_dir: str | os.PathLike,
                     save_filename: str = "model.safetensors", *,
                     skip: frozenset[str] = frozenset()) -> str | None:
    """The full model in the compute dtype (fp32 when training in fp32) as safetensors under
    the model's own names; collective (each ZeRO group is gathered in turn, tp slices are
    all-gathered and put together). One rank per pipeline stage writes (tp rank 0, dp rank
    0): with pp > 1 each stage is one shard ``{stem}-0000{p+1}-of-0000{P}.safetensors`` under
    ``{save_filename}.index.json``. The parameters in ``skip`` are left out. Returns the
    file (or index) on world rank 0, else None."""
    check_filename(save_filename, "save_filename")
    t = state.topology
    specs, gathered = full_model_tensors(state, skip)

    stream, save_dir = gathered, Path(save_dir)
    files = shard_file_names(save_filename, t.pp_size)
    written = list(files)

    def write() -> None:
        try:
            if t.coords["tp"] == 0 and t.zero_rank == 0:  # this stage's file, as a temporary
                write_model_temps(save_dir, specs, stream, filename=files[t.coords["pp"]])
        finally:
            for _ in stream:  # keep taking part in the gathers, whatever happened here
                pass

    first = t.rank == 0
    on_all_ranks(state, "save_16bit_model prepare",
                 lambda: prepare_dir(save_dir) if first else None)
    try:
        on_all_ranks(state, "save_16bit_model", write)
        on_all_ranks(state, "save_16bit_model commit", lambda: _commit_16bit(
            state, save_dir, save_filename, written) if first else None)
    except Exception:
        if first:  # no journal yet: the previous model stays, the new temporaries go
            discard_temps(save_dir, [*written, save_filename + INDEX_SUFFIX])
        raise
    path = save_dir / (save_filename + INDEX_SUFFIX if t.pp_size > 1 else save_filename)
    return str(path) if first else None


def _commit_16bit(state: TrainingState, save_dir: Path, save_filename: str, written: list[str]
                  ) -> None:
    """World rank 0, once every stage's file is written: the index (pp > 1), config.json,
    then all files at once (atomic.commit_files); ``written`` gets their names."""
    if state.topology.pp_size > 1:
        written.append(_write_index(save_dir, save_filename, list(written)))
    extra = render_hf_model_files(hf_model_files(state.module), state.compute_dtype)
    for name, data in extra.items():
        write_temp_bytes(save_dir, name, data)
    written.extend(extra)
    stale = [n for n in model_file_set(save_dir, save_filename) if n not in written]
    commit_files(save_dir, written, stale)


def shard_layouts(state: TrainingState) -> dict[str, ShardLayout]:
    if state.topology.tp_size == 1:
        return {}
    return {name: ShardLayout(**fields)
            for name, fields in tensor_parallel_layouts(state.module).items()}


def _write_index(save_dir: Path, filename: str, files: list[str]) -> str:
    """The Hugging Face index over the stages' files, each written by its own stage: names
    and sizes are read back from their temporaries. Returns the index's name."""
    weight_map: dict[str, str] = {}
    total = 0
    for name in files:
        file = temp_path(save_dir, name)
        with open(file, "rb") as f:  # the tensor bytes: all but the 8-byte length and header
            total += file.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                weight_map.setdefault(key, name)
    return write_index(save_dir, filename, weight_map, total)


def load_weights(state: TrainingState, path: str | os.PathLike) -> None:
    """Load ``model.safetensors`` (a file, an index, or a directory holding one) into the
    sharded engine; collective. Each rank reads only the rows holding its fragments; under
    tensor parallelism a tp-sharded parameter is read whole and cut to the rank's slice,
    and under pipeline parallelism each rank takes its stages' names."""
    names = model_names(state)
    t = state.topology
    layouts = shard_layouts(state)

    def validate() -> tuple[WeightsReader, dict[str, str]]:
        reader = WeightsReader(path)
        return reader, _match_weights(state, names, reader, str(path), layouts)

    where = Path(path) if Path(path).is_dir() else Path(path).parent
    on_all_ranks(state, "load_weights recover",  # a write killed half-way: finish it first
                 lambda: finish_journal(where) if t.rank == 0 else None)
    reader, source = on_all_ranks(state, "load_weights validation", validate)

    def read() -> None:
        with torch.no_grad():
            for view, name, start, end in fragment_views(state.zero.groups, for_load=True):
                if name in layouts:  # the full tensor, cut as tensor parallelism cut it
                    full = reader.read_whole(source[name])
                    full = full.t() if layouts[name].transposed else full
                    local = shard_tensor(full, layouts[name], t.tp_size, t.coords["tp"])
                    view.copy_(local.reshape(-1)[start:end])
                else:
                    view.copy_(reader.read(source[name], start, end))
            for name, buf in names.buffers.items():
                buf.copy_(reader.read_whole(name))

    on_all_ranks(state, "load_weights", read)
    state.zero.optim_state.sync_params()
    logger.info("loaded weights from %s", path)


def _match_weights(state: TrainingState, names: ModelNames, reader: WeightsReader, where: str,
                   layouts: dict[str, ShardLayout]) -> dict[str, str]:
    """``{canonical param: name in the file}`` (a tied parameter may be stored under any of
    its names, also those of another pipeline stage); ValueError listing missing and
    unexpected names and shape mismatches (a tp slice is compared by its whole shape)."""
    present = set(reader.names())
    model_order = set(names.order)
    tied: dict[str, tuple[str, ...]] = {}
    if state.pipeline is not None:  # the other stages' names are expected in the file
        model_order = set(state.pipeline.state_dict_keys)
        tied = {n: t.names for t in state.pipeline.tied_parameters for n in t.names}
    tp = state.topology.tp_size
    source, missing, mismatched = {}, [], []
    for name, slot in state.zero.layout.slots.items():
        candidates = [name, *names.aliases_of(name), *tied.get(name, ())]
        found = [n for n in candidates if n in present]
        if not found:
            missing.append(name)
            continue
        source[name] = found[0]
        shape = full_shape(slot.shape, layouts.get(name), tp)
        if reader.shapes[found[0]] != shape:
            mismatched.append(f"{found[0]}: file {reader.shapes[found[0]]}, model {shape}")
    for name, buf in names.buffers.items():
        if name not in present:
            missing.append(name)
        elif reader.shapes[name] != tuple(buf.shape):
            mismatched.append(f"{name}: file {reader.shapes[name]}, model {tuple(buf.shape)}")
    unexpected = sorted(present - model_order)
    if missing or unexpected or mismatched:
        raise ValueError(f"weights {where} do not match the model:\n"
                         f"  missing (in the model, not in the file): {missing}\n"
                         f"  unexpected (in the file, not in the model): {unexpected}\n"
                         f"  shape mismatches: {mismatched}")
    return source

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

import contextlib
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
from meshzero.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointReader,
    TensorSpec,
    check_tag,
    dtype_from_name,
    read_manifest,
)
from meshzero.checkpoint.mesh import on_all_ranks, piece_name, tensor_parallel_layouts
from meshzero.checkpoint.model_files import (
    INDEX_SUFFIX,
    WeightsReader,
    check_filename,
    model_file_set,
    parse_size,
    shard_file_names,
    write_index,
    write_model_files,
    write_model_temps,
)
from meshzero.checkpoint.state import ModelNames, model_names
from meshzero.checkpoint.tags import readable_tag
from meshzero.checkpoint.training import TrainingState
from meshzero.hf.files import hf_model_files, render_hf_model_files
from meshzero.parallel.shards import ShardLayout, shard_tensor, unshard_tensor
from meshzero.parallel.tensor_state import gather_tp_tensor
from meshzero.zero.fragment_views import fragment_views

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- whole-model weight files ----------------------------------------------------------------
def _tag_directory(ckpt_dir: str | os.PathLike, tag: str | None) -> Path:
    """The tag's directory under a checkpoint directory (if a killed save left it under
    ``.tmp-``/``.old-{tag}``, that complete copy; nothing is renamed), or an error that says
    what is wrong."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(ckpt_dir)!r} does not exist"
                                if not root.exists() else
                                f"{str(ckpt_dir)!r} is not a directory: give the save_dir "
                                "passed to engine.save_checkpoint")
    if tag is None:
        if not (root / LATEST).is_file():
            raise ValueError(f"{ckpt_dir} has no 'latest' file; pass a tag")
        tag = (root / LATEST).read_text().strip()
    check_tag(tag)
    return readable_tag(root, tag)


def _output_dir(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; consolidate writes model.safetensors into a "
                         "directory: give a directory")
    if out.is_dir():
        finish_journal(out)  # a consolidate killed after its commit: its model is there
    existing = model_file_set(out)
    if existing and not overwrite:
        raise ValueError(f"{out / existing[0]} already exists; pass --overwrite "
                         "(overwrite=True) to replace the model in that directory")
    return out


def consolidate(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                tag: str | None = None, dtype: str | torch.dtype = "fp32",
                max_shard_size: str | int = "5GB", overwrite: bool = False) -> list[Path]:
    """Write a checkpoint's full model as safetensors under the model's state_dict names
    (tied names as copies), sharded with ``model.safetensors.index.json`` above
    ``max_shard_size``. A checkpoint cut into (pp, tp) pieces is put back together: stages
    side by side, tensor-parallel slices concatenated as they were cut. One process, no
    distributed; memory: one parameter (all its tp slices) at a time. A model already in
    ``out_dir`` is refused unless ``overwrite``, and then replaced as a whole (a kill
    leaves the old model or the new one, atomic.py)."""
    directory = _tag_directory(ckpt_dir, tag)
    out_dtype = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    out = _output_dir(out_dir, overwrite)
    top = read_manifest(directory)
    tp, pp = top.get("mesh", {}).get("tp", 1), top.get("mesh", {}).get("pp", 1)
    if "pieces" in top:
        pieces = {(p, t): directory / piece_name(p, t) for p in range(pp) for t in range(tp)}
        manifests = {key: read_manifest(where) for key, where in pieces.items()}
    else:
        pieces, manifests = {(0, 0): directory}, {(0, 0): top}
    specs, sources = _consolidate_plan(manifests, pieces, pp, tp, out_dtype)
    with contextlib.ExitStack() as stack:
        readers = {key: stack.enter_context(CheckpointReader(pieces[key], manifests[key]))
                   for key in pieces}
        for key, reader in readers.items():
            reader.check_extents(manifests[key]["params"])

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for spec, (p, src, shape, layout) in zip(specs, sources, strict=True):
                if shape is None:
                    t = readers[(p, 0)].read_whole(src)
                    if tuple(t.shape) != spec.shape:
                        raise ValueError(f"{pieces[(p, 0)] / MANIFEST}: buffer {spec.name} is "
                                         f"{tuple(t.shape)} in the files, the manifest says "
                                         f"{spec.shape}: the manifest was altered")
                else:
                    numel = int(torch.Size(shape).numel())
                    slices = [readers[(p, q)].read(src, "master", 0, numel).view(shape)
                              for q in range(tp if layout is not None else 1)]
                    t = slices[0] if layout is None else unshard_tensor(slices, layout)
                yield spec.name, t.to(spec.dtype)

        return write_model_files(out, specs, tensors(), max_shard_bytes=max_bytes,
                                 extra=render_hf_model_files(top.get("hf_files", {}), out_dtype))


Source = tuple[int, str, "tuple[int, ...] | None", "ShardLayout | None"]


def _consolidate_plan(manifests: dict, pieces: dict, pp: int, tp: int, out_dtype: torch.dtype
                      ) -> tuple[list[TensorSpec], list[Source]]:
    """The output tensors and where each comes from: (pp rank, key, local shape or None (a
    buffer), tp layout)."""
    specs: list[TensorSpec] = []
    sources: list[Source] = []
    seen = set()
    for p in range(pp):
        manifest = manifests[(p, 0)]
        layouts = manifest.get("tensor_parallel", {})
        for name in manifest["state_dict"]:
            if name in seen:  # a tensor tied across stages: written once
                continue
            seen.add(name)
            if name in manifest["buffers"]:
                info = manifest["buffers"][name]
                saved = dtype_from_name(info["dtype"])
                sources.append((p, f"{name}|buffer", None, None))
                specs.append(TensorSpec(name, out_dtype if saved.is_floating_point else saved,
                                        tuple(info["shape"])))
                continue
            src = manifest["aliases"].get(name, name)
            if src not in manifest["params"]:
                raise ValueError(f"{pieces[(p, 0)] / MANIFEST}: {name!r} is in state_dict but "
                                 "not in params or buffers; the manifest is damaged")
            shape = tuple(manifest["params"][src]["shape"])
            layout = ShardLayout(**layouts[name]) if name in layouts else None
            sources.append((p, src, shape, layout))
            specs.append(TensorSpec(name, out_dtype, _full_shape(shape, layout, tp)))
    return specs, sources


def _full_shape(shape: tuple[int, ...], layout: ShardLayout | None, tp: int
                ) -> tuple[int, ...]:
    """The whole tensor's shape from one tp slice's (see ShardLayout)."""
    if layout is None:
        return shape
    full = list(shape)
    full[layout.dim] *= tp
    return tuple(reversed(full)) if layout.transposed else tuple(full)


def save_16bit_model(state: TrainingState, save_dir: str | os.PathLike,
                     save_filename: str = "model.safetensors") -> str | None:
    """The full model in the compute dtype (fp32 when training in fp32) as safetensors under
    the model's own names; collective (each ZeRO group is gathered in turn, tp slices are
    all-gathered and put together). One rank per pipeline stage writes (tp rank 0, dp rank
    0): with pp > 1 each stage is one shard ``{stem}-0000{p+1}-of-0000{P}.safetensors`` under
    ``{save_filename}.index.json``. Returns the file (or index) on world rank 0, else None."""
    check_filename(save_filename, "save_filename")
    names = model_names(state)
    dtype = state.compute_dtype
    t = state.topology
    layouts = _layouts(state)
    specs = []
    for group in state.zero.groups:
        for slot in group.layout.slots:
            shape = _full_shape(slot.shape, layouts.get(slot.name), t.tp_size)
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
                for name in [slot.name, *names.aliases_of(slot.name)]:
                    yield name, value.to(dtype)
        for name, buf in names.buffers.items():
            yield name, buf.detach().to(out_dtype[name])

    stream, save_dir = gathered(), Path(save_dir)
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


def _layouts(state: TrainingState) -> dict[str, ShardLayout]:
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
    layouts = _layouts(state)

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
        shape = _full_shape(slot.shape, layouts.get(name), tp)
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

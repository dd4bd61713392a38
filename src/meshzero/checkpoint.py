"""Sharded checkpoints of a live engine, and whole-model weight files.

    save_checkpoint   every rank writes the fp32 master fragments and optimizer state of the
                      range it owns (rank 0 alone at stage 0, where all ranks own everything),
                      keyed by parameter name and element range; rank 0 writes the manifest
    load_checkpoint   every rank computes its own fragments from its own layout and reads the
                      overlapping ranges from whichever files hold them, so a tag loads at any
                      world size and stage (resharding is arithmetic on names and ranges)
    consolidate       checkpoint -> model.safetensors (or shards + index), one CPU process
    save_16bit_model  live engine -> model.safetensors in the compute dtype (rank 0 writes)
    load_weights      model.safetensors (or index) -> the sharded engine, each rank reading
                      only its fragments

A save is atomic: ranks write into ``.tmp-{tag}``, rank 0 writes the manifest last, renames the
directory to ``{tag}`` and only then points ``latest`` at it. See checkpoint_io for the format.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshzero.checkpoint_io import (
    FORMAT,
    MANIFEST,
    SHARED_FILE,
    VERSION,
    CheckpointReader,
    TensorSpec,
    check_json,
    check_tag,
    commit_tag,
    dtype_from_name,
    dtype_name,
    piece_key,
    prepare_tmp_dir,
    rank_file,
    read_manifest,
    resolve_tag,
    tmp_dir,
    write_json,
    write_safetensors,
)
from meshzero.checkpoint_state import (
    ModelNames,
    buffer_items,
    check_optimizer,
    check_scheduler,
    load_optimizer,
    load_rng,
    load_scheduler,
    match_names,
    model_metadata,
    model_names,
    optimizer_files,
    optimizer_items,
    optimizer_metadata,
    rng_files,
    rng_items,
    scheduler_metadata,
)
from meshzero.weights_io import WeightsReader, parse_size, write_model_files

if TYPE_CHECKING:
    from meshzero.engine import Engine

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- agreement between ranks -----------------------------------------------------------------
def _on_all_ranks(engine: Engine, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank, then agree: if it failed anywhere, it fails everywhere (a
    rank that raised alone would leave the others waiting in the next collective)."""
    error: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # re-raised below, after the others know
        error = exc
    failed = int(error is not None)
    if engine.comm.size > 1:
        flag = torch.tensor([failed], dtype=torch.int32, device=engine.device)
        engine.comm.all_reduce(flag).wait()
        failed = int(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint {what} failed on {failed} other rank(s); see their "
                           "errors")
    return result


# -- save ------------------------------------------------------------------------------------
def save_checkpoint(engine: Engine, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: Any = None) -> str:
    """Write tag ``tag`` (default ``global_step{N}``) under ``save_dir``; collective.

    Returns the tag's directory. ``client_state`` must be JSON-serialisable; it comes back
    from :func:`load_checkpoint`.
    """
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    check_tag(tag)
    check_json(client_state, "client_state")
    names = model_names(engine)
    meta = _manifest_metadata(engine, names, tag, client_state)  # validated before any write
    save_dir = Path(save_dir)
    rank = engine.comm.rank
    t0 = time.perf_counter()
    _on_all_ranks(engine, "prepare", lambda: prepare_tmp_dir(save_dir, tag) if rank == 0 else None)
    _on_all_ranks(engine, "write", lambda: write_rank_state(engine, names, tmp_dir(save_dir, tag)))
    _on_all_ranks(engine, "commit",
                  lambda: _commit(engine, save_dir, tag, meta) if rank == 0 else None)
    logger.info("saved checkpoint %s in %.3f s", save_dir / tag, time.perf_counter() - t0)
    return str(save_dir / tag)


def _manifest_metadata(engine: Engine, names: ModelNames, tag: str, client_state: Any) -> dict:
    from meshzero import __version__

    meta = {
        "format": FORMAT, "version": VERSION, "tag": tag, "meshzero_version": __version__,
        "torch_version": torch.__version__, "world_size": engine.comm.size,
        "mesh": dict(engine.topology.sizes), "stage": engine.zero_stage,
        "compute_dtype": dtype_name(engine.compute_dtype), "saved_param_dtype": "float32",
        **model_metadata(engine, names),
        "optimizer": optimizer_metadata(engine),
        "scheduler": scheduler_metadata(engine),
        "loss_scaler": engine.loss_scaler.state_dict(),
        "steps": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                  "skipped_steps": engine.skipped_steps},
        "client_state": client_state,
    }
    check_json(meta, "checkpoint metadata")
    return meta


def _param_targets(engine: Engine, *, for_load: bool) -> Iterator[tuple[torch.Tensor, str, int,
                                                                        int]]:
    """``(flat view, name, start, end)`` for every fragment whose values this rank saves
    (its owned range) or loads (the owned range; for resident frozen groups the whole
    buffer, which no all-gather refills)."""
    for group in engine.zero.groups:
        lo, hi = group.owned
        if group.trainable:
            target = group.master
        elif group.sharded:  # frozen, stage 3: the shard is the owned range
            target = group.shard
        elif for_load:
            lo, hi = 0, group.layout.padded_numel
            target = group.full
        else:
            target = group.full[lo:hi]
        for frag in group.layout.fragments(lo, hi):
            a = frag.local_offset
            yield target[a:a + frag.numel], frag.slot.name, frag.start, frag.end


def write_rank_state(engine: Engine, names: ModelNames, directory: Path) -> None:
    """This rank's safetensors file (+ ``shared.safetensors`` on rank 0) and a small JSON
    note for rank 0 to merge into the manifest."""
    rank = engine.comm.rank
    info: dict[str, Any] = {"rank": rank, "state_kinds": {}, "param_group_of": {},
                            "extra_state": {}}
    items = []
    if engine.zero_stage > 0 or rank == 0:  # at stage 0 every rank owns everything
        for view, name, start, end in _param_targets(engine, for_load=False):
            spec = TensorSpec(piece_key(name, start, end, "master"), torch.float32, (end - start,))
            items.append((spec, view))
        items += optimizer_items(engine, info)
    items += rng_items(rank, info)
    files = [_write_items(directory / rank_file(rank), items)]
    if rank == 0 and names.buffers:
        files.append(_write_items(directory / SHARED_FILE, buffer_items(names)))
    info["files"] = files
    write_json(directory / f"rank{rank:05d}.json", info)


def _write_items(path: Path, items: list) -> dict:
    specs = [spec for spec, _ in items]
    tensors = ((spec.name, t.detach().to(spec.dtype)) for spec, t in items)
    nbytes, sha256 = write_safetensors(path, specs, tensors)
    return {"name": path.name, "bytes": nbytes, "sha256": sha256,
            "keys": [s.name for s in specs]}


def _commit(engine: Engine, save_dir: Path, tag: str, meta: dict) -> None:
    """Rank 0: merge the ranks' notes into the manifest, write it, rename, update latest."""
    directory = tmp_dir(save_dir, tag)
    manifest = dict(meta, files=[], rng={})
    optim = manifest["optimizer"] = dict(meta["optimizer"], state_kinds={}, param_group_of={},
                                         extra_state={})
    for rank in range(engine.comm.size):
        note = directory / f"rank{rank:05d}.json"
        info = json.loads(note.read_text())
        manifest["files"] += info["files"]
        manifest["rng"][str(rank)] = info["rng"]
        for key in ("state_kinds", "param_group_of", "extra_state"):
            optim[key].update(info[key])
        note.unlink()
    write_json(directory / MANIFEST, manifest)
    commit_tag(save_dir, tag)


# -- load ------------------------------------------------------------------------------------
def load_checkpoint(engine: Engine, load_dir: str | os.PathLike, tag: str | None = None,
                    load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str | None, Any]:
    """Load tag ``tag`` (default: the one ``latest`` names) at any world size and stage;
    collective. Returns ``(tag directory, client_state)``, or ``(None, None)`` with a warning
    when ``load_dir`` has no ``latest`` file."""
    directory = resolve_tag(load_dir, tag)
    if directory is None:
        logger.warning("%s has no 'latest' file: no checkpoint loaded", load_dir)
        return None, None
    t0 = time.perf_counter()
    names = model_names(engine)
    opened = _on_all_ranks(engine, "manifest",
                           lambda: CheckpointReader(directory, read_manifest(directory)))
    manifest = opened.manifest
    with opened as reader:
        def validate() -> dict[str, str]:
            rename = match_names(names, engine, manifest, str(directory))
            files = _param_files(engine, reader, rename) | rng_files(reader, engine.comm.rank)
            if names.buffers:
                files |= {reader.file_of(f"{n}|buffer") for n in names.buffers}
            if load_lr_scheduler_states:
                check_scheduler(engine, manifest["scheduler"])
            if load_optimizer_states:
                check_optimizer(engine, manifest["optimizer"], rename)
                files |= optimizer_files(engine, reader, manifest["optimizer"], rename)
            reader.verify(files)  # every file this rank reads, against the manifest's sha256
            return rename

        rename = _on_all_ranks(engine, "validation", validate)
        _on_all_ranks(engine, "read", lambda: _apply(engine, names, reader, manifest, rename,
                                                    load_optimizer_states,
                                                    load_lr_scheduler_states))
    engine.zero.optim_state.sync_params()
    logger.info("loaded checkpoint %s (saved at world size %d, stage %d) in %.3f s", directory,
                manifest["world_size"], manifest["stage"], time.perf_counter() - t0)
    return str(directory), manifest["client_state"]


def _param_files(engine: Engine, reader: CheckpointReader, rename: dict[str, str]) -> set[int]:
    files = set()
    for _, name, start, end in _param_targets(engine, for_load=True):
        files |= {p.file for p in reader.locate(rename[name], "master", start, end)}
    return files


def _apply(engine: Engine, names: ModelNames, reader: CheckpointReader, manifest: dict,
           rename: dict[str, str], load_optimizer_states: bool,
           load_lr_scheduler_states: bool) -> None:
    """Local part of a load (no collectives): values, buffers, optimizer, scheduler, RNG."""
    with torch.no_grad():
        for view, name, start, end in _param_targets(engine, for_load=True):
            view.copy_(reader.read(rename[name], "master", start, end))
        for name, buf in names.buffers.items():
            buf.copy_(reader.read_whole(f"{name}|buffer"))
    if load_optimizer_states:
        load_optimizer(engine, reader, manifest["optimizer"], rename)
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    if load_lr_scheduler_states:
        load_scheduler(engine, manifest["scheduler"], set_lr=not load_optimizer_states)
    steps = manifest["steps"]
    engine.global_steps = steps["global_steps"]
    engine.micro_steps = steps["micro_steps"]
    engine.skipped_steps = steps["skipped_steps"]
    load_rng(reader, manifest["rng"], engine.comm.rank)


# -- whole-model weight files ----------------------------------------------------------------
def consolidate(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                tag: str | None = None, dtype: str | torch.dtype = "fp32",
                max_shard_size: str | int = "5GB") -> list[Path]:
    """Write a checkpoint's full model as safetensors under the model's state_dict names
    (tied names as copies), sharded with ``model.safetensors.index.json`` above
    ``max_shard_size``. One process, no distributed; memory: one parameter at a time."""
    directory = resolve_tag(ckpt_dir, tag)
    if directory is None:
        raise ValueError(f"{ckpt_dir} has no 'latest' file; pass a tag")
    out_dtype = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    manifest = read_manifest(directory)
    specs, sources = [], []
    for name in manifest["state_dict"]:
        if name in manifest["buffers"]:
            info = manifest["buffers"][name]
            saved = dtype_from_name(info["dtype"])
            sources.append((f"{name}|buffer", None))
            specs.append(TensorSpec(name, out_dtype if saved.is_floating_point else saved,
                                    tuple(info["shape"])))
        else:
            src = manifest["aliases"].get(name, name)
            shape = tuple(manifest["params"][src]["shape"])
            sources.append((src, shape))
            specs.append(TensorSpec(name, out_dtype, shape))
    with CheckpointReader(directory, manifest) as reader:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for spec, (src, shape) in zip(specs, sources, strict=True):
                if shape is None:
                    t = reader.read_whole(src)
                else:
                    numel = int(torch.Size(shape).numel())
                    t = reader.read(src, "master", 0, numel).view(shape)
                yield spec.name, t.to(spec.dtype)

        return write_model_files(out_dir, specs, tensors(), max_shard_bytes=max_bytes)


def save_16bit_model(engine: Engine, save_dir: str | os.PathLike,
                     save_filename: str = "model.safetensors") -> str | None:
    """The full model in the compute dtype (fp32 when training in fp32) as one safetensors
    file; collective (each group is gathered in turn), rank 0 writes. Returns the path on
    rank 0, None elsewhere."""
    names = model_names(engine)
    dtype = engine.compute_dtype
    specs = []
    for group in engine.zero.groups:
        for slot in group.layout.slots:
            for name in [slot.name, *names.aliases_of(slot.name)]:
                specs.append(TensorSpec(name, dtype, slot.shape))
    out_dtype = {n: dtype if b.is_floating_point() else b.dtype for n, b in names.buffers.items()}
    specs += [TensorSpec(n, out_dtype[n], tuple(b.shape)) for n, b in names.buffers.items()]

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for group in engine.zero.groups:
            flat = engine.zero.full_fp32(group)  # collective at stages 1-3
            for slot in group.layout.slots:
                t = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).to(dtype)
                for name in [slot.name, *names.aliases_of(slot.name)]:
                    yield name, t
        for name, buf in names.buffers.items():
            yield name, buf.detach().to(out_dtype[name])

    stream = gathered()
    path = Path(save_dir) / save_filename

    def write() -> None:
        try:
            if engine.comm.rank == 0:
                write_model_files(save_dir, specs, stream, filename=save_filename)
        finally:
            for _ in stream:  # keep taking part in the gathers, whatever happened here
                pass

    _on_all_ranks(engine, "save_16bit_model", write)
    return str(path) if engine.comm.rank == 0 else None


def load_weights(engine: Engine, path: str | os.PathLike) -> None:
    """Load ``model.safetensors`` (a file, an index, or a directory holding one) into the
    sharded engine; collective. Each rank reads only the rows holding its fragments."""
    names = model_names(engine)

    def validate() -> tuple[WeightsReader, dict[str, str]]:
        reader = WeightsReader(path)
        return reader, _match_weights(engine, names, reader, str(path))

    reader, source = _on_all_ranks(engine, "load_weights validation", validate)

    def read() -> None:
        with torch.no_grad():
            for view, name, start, end in _param_targets(engine, for_load=True):
                view.copy_(reader.read(source[name], start, end))
            for name, buf in names.buffers.items():
                buf.copy_(reader.read_whole(name))

    _on_all_ranks(engine, "load_weights", read)
    engine.zero.optim_state.sync_params()
    logger.info("loaded weights from %s", path)


def _match_weights(engine: Engine, names: ModelNames, reader: WeightsReader,
                   where: str) -> dict[str, str]:
    """``{canonical param: name in the file}`` (a tied parameter may be stored under any of
    its names); ValueError listing missing and unexpected names and shape mismatches."""
    present = set(reader.names())
    source, missing, mismatched = {}, [], []
    for name, slot in engine.zero.layout.slots.items():
        found = [n for n in [name, *names.aliases_of(name)] if n in present]
        if not found:
            missing.append(name)
            continue
        source[name] = found[0]
        if reader.shapes[found[0]] != slot.shape:
            mismatched.append(f"{found[0]}: file {reader.shapes[found[0]]}, model {slot.shape}")
    for name, buf in names.buffers.items():
        if name not in present:
            missing.append(name)
        elif reader.shapes[name] != tuple(buf.shape):
            mismatched.append(f"{name}: file {reader.shapes[name]}, model {tuple(buf.shape)}")
    unexpected = sorted(present - set(names.order))
    if missing or unexpected or mismatched:
        raise ValueError(f"weights {where} do not match the model:\n"
                         f"  missing (in the model, not in the file): {missing}\n"
                         f"  unexpected (in the file, not in the model): {unexpected}\n"
                         f"  shape mismatches: {mismatched}")
    return source

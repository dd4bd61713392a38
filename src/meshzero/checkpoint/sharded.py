"""Sharded checkpoints of a live engine (whole-model weight files: weights.py).

    save_checkpoint   every rank writes the fp32 master fragments and optimizer state of the
                      range it owns (rank 0 alone at stage 0, where all ranks own everything),
                      keyed by parameter name and element range; rank 0 writes the manifest
    load_checkpoint   every rank computes its own fragments from its own layout and reads the
                      overlapping ranges from whichever files hold them, so a tag loads at any
                      data-parallel size and stage (resharding is arithmetic on names and
                      ranges)

With tensor or pipeline parallelism each (pp, tp) piece of the model is such a checkpoint in a
subdirectory of the tag, written by the piece's ZeRO ranks (mesh.py). A save is
atomic: the ranks agree on the tag, write into ``.tmp-{tag}``, world rank 0 writes the
manifests last, renames the directory to ``{tag}`` (a re-save swaps it with the old copy in
one step) and only then points ``latest`` at it; a
failed save removes ``.tmp-{tag}``, and every save and load first repairs what a killed one
left (tags.py). See format.py for the format and docs/failures.md for the guarantees.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from meshzero.checkpoint.atomic import fsync_dir, make_dir, remove_tree
from meshzero.checkpoint.format import (
    FORMAT,
    MANIFEST,
    SHARED_FILE,
    VERSION,
    CheckpointReader,
    TensorSpec,
    check_json,
    check_tag,
    commit_tag,
    dtype_name,
    piece_key,
    prepare_tmp_dir,
    rank_file,
    read_manifest,
    resolve_tag,
    tmp_dir,
    write_json,
    write_manifest,
    write_safetensors,
)
from meshzero.checkpoint.mesh import (
    ModelPiece,
    agree_on_tag,
    check_mesh,
    mesh_manifest,
    model_piece,
    tensor_parallel_layouts,
)
from meshzero.checkpoint.mesh import on_all_ranks as _on_all_ranks
from meshzero.checkpoint.state import (
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
from meshzero.checkpoint.tags import recover_tags
from meshzero.checkpoint.training import TrainingState
from meshzero.hf.files import hf_model_files
from meshzero.zero.fragment_views import fragment_views

__all__ = ["load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

PIECE_NOTE = "piece.json"  # a piece's metadata, for world rank 0 to turn into its manifest


# -- save ------------------------------------------------------------------------------------
def save_checkpoint(state: TrainingState, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: Any = None) -> str:
    """Write tag ``tag`` (default ``global_step{N}``) under ``save_dir``; collective.

    Returns the tag's directory. ``client_state`` must be JSON-serialisable; it comes back
    from :func:`load_checkpoint`.
    """
    tag = f"global_step{state.counters.global_steps}" if tag is None else str(tag)
    check_tag(tag)
    check_json(client_state, "client_state")
    names = model_names(state)
    piece = model_piece(state)
    meta = _manifest_metadata(state, names, piece, tag, client_state)  # before any write
    save_dir = Path(save_dir)
    first = state.topology.rank == 0  # world rank 0 prepares and commits
    t0 = time.perf_counter()
    agree_on_tag(state, tag)

    def write() -> None:
        directory = piece.directory(tmp_dir(save_dir, tag))
        if piece.file_rank == 0:
            write_json(directory / PIECE_NOTE, meta)
        write_rank_state(state, names, piece, directory)

    try:
        _on_all_ranks(state, "prepare", lambda: _prepare(save_dir, tag, piece) if first else None)
        _on_all_ranks(state, "write", write)
        _on_all_ranks(state, "commit",
                      lambda: _commit(state, piece, save_dir, tag, meta) if first else None)
    except Exception:
        if first:  # every rank knows of the failure (or a rank died): remove the temporary
            remove_tree(tmp_dir(save_dir, tag))
        raise
    logger.info("saved checkpoint %s in %.3f s", save_dir / tag, time.perf_counter() - t0)
    return str(save_dir / tag)


def _manifest_metadata(state: TrainingState, names: ModelNames, piece: ModelPiece, tag: str,
                       client_state: Any) -> dict:
    from meshzero import __version__

    meta = {
        "format": FORMAT, "version": VERSION, "tag": tag, "meshzero_version": __version__,
        "torch_version": torch.__version__, "world_size": piece.num_files,
        # sp only when used: a checkpoint without it reads as before
        "mesh": {axis: n for axis, n in state.topology.sizes.items() if axis != "sp" or n > 1},
        "stage": state.zero_stage,
        "compute_dtype": dtype_name(state.compute_dtype), "saved_param_dtype": "float32",
        **model_metadata(state, names),
        "optimizer": optimizer_metadata(state),
        "scheduler": scheduler_metadata(state),
        "loss_scaler": state.loss_scaler.state_dict(),
        "steps": dataclasses.asdict(state.counters),  # global, micro, skipped steps
        "client_state": client_state,
    }
    if hf_files := hf_model_files(state.module):  # for consolidate's config.json
        meta["hf_files"] = hf_files
    if piece.split:
        meta["piece"] = {"pp": piece.pp, "tp": piece.tp}
    if piece.tp_size > 1:
        meta["tensor_parallel"] = tensor_parallel_layouts(state.module)
    check_json(meta, "checkpoint metadata")
    return meta


def _prepare(save_dir: Path, tag: str, piece: ModelPiece) -> None:
    recover_tags(save_dir)  # a save killed before: put its tag back first
    prepare_tmp_dir(save_dir, tag)
    for directory in piece.all_directories(tmp_dir(save_dir, tag)):
        if directory != tmp_dir(save_dir, tag):
            make_dir(directory)


def write_rank_state(state: TrainingState, names: ModelNames, piece: ModelPiece,
                     directory: Path) -> None:
    """This rank's safetensors file in its piece's directory (+ ``shared.safetensors`` on
    the piece's first rank) and a small JSON note for world rank 0 to merge into the
    piece's manifest. Files are named by dp rank; MiCS blocks after the first write only
    their RNG state."""
    rank = piece.file_rank
    info: dict[str, Any] = {"rank": rank, "state_kinds": {}, "param_group_of": {},
                            "extra_state": {}}
    items = []
    # at stage 0 every rank owns everything: the first one writes it
    if piece.writes_state and (state.zero_stage > 0 or state.zero.comm.rank == 0):
        for view, name, start, end in fragment_views(state.zero.groups, for_load=False):
            spec = TensorSpec(piece_key(name, start, end, "master"), torch.float32, (end - start,))
            items.append((spec, view))
        items += optimizer_items(state, info)
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


def _commit(state: TrainingState, piece: ModelPiece, save_dir: Path, tag: str, meta: dict) -> None:
    """World rank 0: every piece's manifest from its ranks' notes, the tag's manifest (when
    the model is cut into pieces), then rename and update latest."""
    tmp = tmp_dir(save_dir, tag)
    directories = piece.all_directories(tmp)
    for directory in directories:
        _write_piece_manifest(directory, piece.num_files)
    if piece.split:  # the top manifest last: it makes the tag complete (tags.py)
        for directory in directories:
            fsync_dir(directory)
        write_manifest(tmp / MANIFEST, mesh_manifest(state, meta))
    commit_tag(save_dir, tag, [d for d in directories if d != tmp])


def _write_piece_manifest(directory: Path, num_files: int) -> None:
    """The piece's manifest from its notes (written after every rank file was fsynced);
    the notes are removed once it is written."""
    notes = [directory / PIECE_NOTE] + [directory / f"rank{r:05d}.json" for r in range(num_files)]
    meta = json.loads(notes[0].read_text())
    manifest = dict(meta, files=[], rng={})
    optim = manifest["optimizer"] = dict(meta["optimizer"], state_kinds={}, param_group_of={},
                                         extra_state={})
    for rank in range(num_files):
        info = json.loads(notes[1 + rank].read_text())
        manifest["files"] += info["files"]
        manifest["rng"][str(rank)] = info["rng"]
        for key in ("state_kinds", "param_group_of", "extra_state"):
            optim[key].update(info[key])
    fsync_dir(directory)  # the rank files' entries are durable before the manifest names them
    write_manifest(directory / MANIFEST, manifest)
    for note in notes:
        remove_tree(note)


# -- load ------------------------------------------------------------------------------------
def load_checkpoint(state: TrainingState, load_dir: str | os.PathLike, tag: str | None = None,
                    load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str | None, Any]:
    """Load tag ``tag`` (default: the one ``latest`` names) at any data-parallel size and
    stage (tp and pp as saved); collective. Returns ``(tag directory, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` file."""
    # an engine without an optimizer (forward only) loads the model of any checkpoint
    load_optimizer_states = load_optimizer_states and state.optimizer is not None
    _on_all_ranks(state, "recover",  # a save killed before: put its tag back first
                  lambda: recover_tags(Path(load_dir)) if state.topology.rank == 0 else None)
    directory = resolve_tag(load_dir, tag)
    if directory is None:
        logger.warning("%s has no 'latest' file: no checkpoint loaded", load_dir)
        return None, None
    t0 = time.perf_counter()
    names = model_names(state)
    piece = model_piece(state)

    def open_piece() -> tuple[dict, CheckpointReader]:
        top = read_manifest(directory)
        check_mesh(state, top, str(directory))
        where = piece.directory(directory)
        return top, CheckpointReader(where, top if where == directory else read_manifest(where))

    top, opened = _on_all_ranks(state, "manifest", open_piece)
    manifest = opened.manifest
    with opened as reader:
        def validate() -> dict[str, str]:
            reader.check_extents(manifest["params"])
            rename = match_names(names, state, manifest, str(reader.directory))
            files = _param_files(state, reader, rename) | rng_files(reader, piece.file_rank)
            if names.buffers:
                files |= {reader.file_of(f"{n}|buffer") for n in names.buffers}
            if load_lr_scheduler_states:
                check_scheduler(state, manifest["scheduler"])
            if load_optimizer_states:
                check_optimizer(state, manifest["optimizer"], rename)
                files |= optimizer_files(state, reader, manifest["optimizer"], rename)
            reader.verify(files)  # every file this rank reads, against the manifest's sha256
            return rename

        rename = _on_all_ranks(state, "validation", validate)
        _on_all_ranks(state, "read", lambda: _apply(state, names, reader, manifest, rename,
                                                    piece.file_rank, load_optimizer_states,
                                                    load_lr_scheduler_states))
    state.zero.optim_state.sync_params()
    logger.info("loaded checkpoint %s (saved at world size %d, stage %d) in %.3f s", directory,
                top["world_size"], top["stage"], time.perf_counter() - t0)
    return str(directory), top["client_state"]


def _param_files(state: TrainingState, reader: CheckpointReader, rename: dict[str, str]
                 ) -> set[int]:
    files = set()
    for _, name, start, end in fragment_views(state.zero.groups, for_load=True):
        files |= {p.file for p in reader.locate(rename[name], "master", start, end)}
    return files


def _apply(state: TrainingState, names: ModelNames, reader: CheckpointReader, manifest: dict,
           rename: dict[str, str], file_rank: int, load_optimizer_states: bool,
           load_lr_scheduler_states: bool) -> None:
    """Local part of a load (no collectives): values, buffers, optimizer, scheduler, RNG."""
    if load_optimizer_states:  # frozen now, trained before: its master and state come back
        saved = manifest["optimizer"]["param_group_of"]
        state.zero.make_trainable(n for n, src in rename.items() if src in saved)
    with torch.no_grad():
        for view, name, start, end in fragment_views(state.zero.groups, for_load=True):
            view.copy_(reader.read(rename[name], "master", start, end))
        for name, buf in names.buffers.items():
            buf.copy_(reader.read_whole(f"{name}|buffer"))
    if load_optimizer_states:
        load_optimizer(state, reader, manifest["optimizer"], rename)
        state.loss_scaler.load_state_dict(manifest["loss_scaler"])
    if load_lr_scheduler_states:
        load_scheduler(state, manifest["scheduler"], set_lr=not load_optimizer_states)
    steps = manifest["steps"]
    state.counters.global_steps = steps["global_steps"]
    state.counters.micro_steps = steps["micro_steps"]
    state.counters.skipped_steps = steps["skipped_steps"]
    load_rng(reader, manifest["rng"], file_rank)

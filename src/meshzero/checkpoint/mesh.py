"""Checkpoints on a (pp, dp, tp) mesh: which ranks write which files, and agreement.

A **piece** of the model is what one (pp rank, tp rank) coordinate holds: its pipeline
stage(s), with its tensor-parallel slices. ZeRO shards a piece over the ranks of its ZeRO
shard group (all of dp, or under MiCS a block of dp), and those ranks save it as a normal
meshzero checkpoint: every rank's file is named by its dp rank, and only the first MiCS
block writes parameter and optimizer values (the other blocks hold the same shards; their
ranks write just their RNG state). Without tp and pp there is one piece, and it is the tag
directory itself, so the format is the one without a mesh. With tp or pp::

    global_step100/
      manifest.json         format, tag, world size, mesh sizes, steps, client_state and
                            the piece directories (no files of its own)
      pp0_tp0/manifest.json a normal checkpoint of pp rank 0, tp rank 0's module
      pp0_tp0/rank00000.safetensors ...
      pp0_tp1/...

A tag loads only on a mesh with the same tp and pp sizes (the pieces are cut that way); the
dp size and the ZeRO stage may change, as without a mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.checkpoint.training import TrainingState
from meshzero.comm import Communicator


@dataclass(frozen=True)
class ModelPiece:
    """This rank's piece of the model and its place among the ranks that save it."""

    pp: int
    tp: int
    pp_size: int
    tp_size: int
    file_rank: int  # the dp (x sp) rank: names this rank's file (and RNG state) in the piece
    num_files: int  # the dp (x sp) size: one file per rank ZeRO shards over
    writes_state: bool  # False on MiCS blocks after the first (same shards as the first)

    @property
    def split(self) -> bool:
        """Whether the model is cut into several pieces (tp or pp > 1)."""
        return self.pp_size * self.tp_size > 1

    def directory(self, tag_dir: Path) -> Path:
        return tag_dir / piece_name(self.pp, self.tp) if self.split else tag_dir

    def all_directories(self, tag_dir: Path) -> list[Path]:
        if not self.split:
            return [tag_dir]
        return [tag_dir / piece_name(p, t) for p in range(self.pp_size)
                for t in range(self.tp_size)]


def piece_name(pp: int, tp: int) -> str:
    return f"pp{pp}_tp{tp}"


def model_piece(state: TrainingState) -> ModelPiece:
    t = state.topology
    return ModelPiece(pp=t.coords["pp"], tp=t.coords["tp"], pp_size=t.pp_size,
                      tp_size=t.tp_size, file_rank=t.zero_rank, num_files=t.zero_size,
                      writes_state=state.writes_state)


def tensor_parallel_layouts(module: nn.Module) -> dict[str, dict]:
    """``{state_dict name: ShardLayout fields}`` of every tp-sharded parameter of this rank's
    module (tied names included): how consolidate puts the slices back together."""
    from meshzero.parallel.tensor import TensorParallelLayer

    out = {}
    for prefix, layer in module.named_modules(remove_duplicate=False):
        if isinstance(layer, TensorParallelLayer):
            for name, layout in layer.tp_layouts.items():
                out[f"{prefix}.{name}" if prefix else name] = dataclasses.asdict(layout)
    return out


def check_mesh(state: TrainingState, manifest: dict, where: str) -> None:
    """ValueError unless the checkpoint was cut into pieces by the same tp and pp sizes."""
    saved = manifest.get("mesh", {})
    saved_tp, saved_pp = saved.get("tp", 1), saved.get("pp", 1)
    tp, pp = state.topology.tp_size, state.topology.pp_size
    if (saved_tp, saved_pp) != (tp, pp):
        raise ValueError(
            f"checkpoint {where} was saved with tensor_parallel.size {saved_tp} and "
            f"pipeline_parallel.size {saved_pp}; this engine has tensor_parallel.size {tp} and "
            f"pipeline_parallel.size {pp}. Load it with the same tensor_parallel.size and "
            "pipeline_parallel.size (the data-parallel size and ZeRO stage may differ)")


def mesh_manifest(state: TrainingState, piece_meta: dict) -> dict:
    """The top-level manifest of a tag cut into pieces: what describes the whole run (taken
    from this rank's piece metadata) and the piece directories; no files of its own."""
    keep = ("format", "version", "tag", "meshzero_version", "torch_version", "mesh", "stage",
            "compute_dtype", "steps", "client_state", "client_state_encoding",
            "excluded_parameters")
    t = state.topology
    return {**{k: piece_meta[k] for k in keep if k in piece_meta}, "world_size": t.world_size,
            "pieces": [piece_name(p, q) for p in range(t.pp_size) for q in range(t.tp_size)],
            "files": []}


_TAG_BYTES = 256  # format.MAX_TAG_BYTES fits, with its length


def agree_on_tag(state: TrainingState, tag: str) -> None:
    """ValueError on every rank, naming the tags and their ranks, unless all ranks save under
    ``tag`` (one all-gather of the tag's bytes, before anything is written)."""
    size = state.topology.world_size
    if size == 1:
        return
    raw = tag.encode()[:_TAG_BYTES - 1]
    mine = torch.zeros(_TAG_BYTES, dtype=torch.int32, device=state.device)
    mine[0] = len(raw)
    mine[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    out = torch.empty(size * _TAG_BYTES, dtype=torch.int32, device=state.device)
    Communicator(dist.group.WORLD, "checkpoint", state.stats).all_gather(out, mine).wait()
    rows = out.view(size, _TAG_BYTES).cpu().tolist()
    tags: dict[str, list[int]] = {}
    for rank, row in enumerate(rows):
        tags.setdefault(bytes(row[1:1 + row[0]]).decode(errors="replace"), []).append(rank)
    if len(tags) > 1:
        listed = "; ".join(f"{t!r} on rank(s) {ranks}" for t, ranks in tags.items())
        raise ValueError(f"save_checkpoint: the ranks pass different tags ({listed}); every "
                         "rank must pass the same tag")


def on_all_ranks(state: TrainingState, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank of the world, then agree: if it failed anywhere, it fails
    everywhere (a rank that raised alone would leave the others waiting in the next
    collective)."""
    error: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # re-raised below, after the others know
        error = exc
    failed = int(error is not None)
    if state.topology.world_size > 1:
        world = Communicator(dist.group.WORLD, "checkpoint", state.stats)
        flag = torch.tensor([failed], dtype=torch.int32, device=state.device)
        world.all_reduce(flag).wait()
        failed = int(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint {what} failed on {failed} other rank(s); see their "
                           "errors")
    return result

"""A checkpoint tag's whole tensors, read in one CPU process without the model or a process
group: :class:`TagTensors` (name by name, under the model's state_dict names) and
:func:`consolidate` (into model.safetensors, or shards and an index).

A tag cut into (pp, tp) pieces is put back together: stages side by side, tensor-parallel
slices concatenated as they were cut. Memory: one parameter (all its tp slices) at a time.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path

import torch

from meshzero.checkpoint.atomic import finish_journal
from meshzero.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointReader,
    TensorSpec,
    check_tag,
    dtype_from_name,
    read_manifest,
)
from meshzero.checkpoint.mesh import piece_name
from meshzero.checkpoint.model_files import model_file_set, parse_size, write_model_files
from meshzero.checkpoint.tags import readable_tag
from meshzero.hf.files import render_hf_model_files
from meshzero.parallel.shards import ShardLayout, unshard_tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# where an output tensor comes from: (pp rank, key, local shape or None (a buffer), tp layout)
Source = tuple[int, str, "tuple[int, ...] | None", "ShardLayout | None"]


def tag_directory(ckpt_dir: str | os.PathLike, tag: str | None) -> Path:
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


def full_shape(shape: tuple[int, ...], layout: ShardLayout | None, tp: int) -> tuple[int, ...]:
    """The whole tensor's shape from one tp slice's (see ShardLayout)."""
    if layout is None:
        return shape
    full = list(shape)
    full[layout.dim] *= tp
    return tuple(reversed(full)) if layout.transposed else tuple(full)


class TagTensors:
    """The whole tensors of a checkpoint tag under the model's state_dict names (tied names
    each listed, reading the same values), in ``dtype`` (buffers that are not floating point
    keep theirs). ``exclude_frozen``: parameters saved as not trained are left out. Files are
    checked against the manifest's sha256 when first read. Use as a context manager (or
    :meth:`close`): it holds the files open."""

    def __init__(self, ckpt_dir: str | os.PathLike, tag: str | None = None, *,
                 dtype: torch.dtype = torch.float32, exclude_frozen: bool = False):
        self.directory = tag_directory(ckpt_dir, tag)
        self.top = read_manifest(self.directory)
        self.tp = self.top.get("mesh", {}).get("tp", 1)
        pp = self.top.get("mesh", {}).get("pp", 1)
        if "pieces" in self.top:
            self.pieces = {(p, t): self.directory / piece_name(p, t)
                           for p in range(pp) for t in range(self.tp)}
            self.manifests = {key: read_manifest(where) for key, where in self.pieces.items()}
        else:
            self.pieces, self.manifests = {(0, 0): self.directory}, {(0, 0): self.top}
        self.specs, self.sources = _plan(self.manifests, self.pieces, pp, self.tp, dtype,
                                         exclude_frozen)
        self._index = {spec.name: i for i, spec in enumerate(self.specs)}
        self._stack = contextlib.ExitStack()
        with self._stack as stack:  # closed here only if a check below fails
            self.readers = {key: stack.enter_context(CheckpointReader(where, self.manifests[key]))
                            for key, where in self.pieces.items()}
            for key, reader in self.readers.items():
                reader.check_extents(self.manifests[key]["params"])
            self._stack = stack.pop_all()

    def __enter__(self) -> TagTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def close_when_collected(self) -> None:
        """Close the files once this object is garbage (lazy readers hold it meanwhile)."""
        weakref.finalize(self, self._stack.close)

    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def spec(self, name: str) -> TensorSpec:
        """The shape and dtype :meth:`read` gives ``name``."""
        return self.specs[self._index[name]]

    def source(self, name: str) -> Source:
        """Where ``name``'s values are stored (tied names share one source)."""
        return self.sources[self._index[name]]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, a new CPU tensor."""
        spec = self.specs[self._index[name]]
        p, src, shape, layout = self.sources[self._index[name]]
        if shape is None:
            t = self.readers[(p, 0)].read_whole(src)
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"{self.pieces[(p, 0)] / MANIFEST}: buffer {spec.name} is "
                                 f"{tuple(t.shape)} in the files, the manifest says "
                                 f"{spec.shape}: the manifest was altered")
        else:
            numel = int(torch.Size(shape).numel())
            slices = [self.readers[(p, q)].read(src, "master", 0, numel).view(shape)
                      for q in range(self.tp if layout is not None else 1)]
            t = slices[0] if layout is None else unshard_tensor(slices, layout)
        return t.to(spec.dtype)


def _plan(manifests: dict, pieces: dict, pp: int, tp: int, out_dtype: torch.dtype,
          exclude_frozen: bool) -> tuple[list[TensorSpec], list[Source]]:
    """The output tensors and where each comes from."""
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
            if exclude_frozen and manifest["params"][src].get("requires_grad") is False:
                continue
            shape = tuple(manifest["params"][src]["shape"])
            layout = ShardLayout(**layouts[name]) if name in layouts else None
            sources.append((p, src, shape, layout))
            specs.append(TensorSpec(name, out_dtype, full_shape(shape, layout, tp)))
    return specs, sources


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
                max_shard_size: str | int = "5GB", overwrite: bool = False,
                exclude_frozen: bool = False) -> list[Path]:
    """Write a checkpoint's full model as safetensors under the model's state_dict names
    (tied names as copies), sharded with ``model.safetensors.index.json`` above
    ``max_shard_size``. A checkpoint cut into (pp, tp) pieces is put back together: stages
    side by side, tensor-parallel slices concatenated as they were cut. One process, no
    distributed; memory: one parameter (all its tp slices) at a time. A model already in
    ``out_dir`` is refused unless ``overwrite``, and then replaced as a whole (a kill
    leaves the old model or the new one, atomic.py). ``exclude_frozen``: parameters saved
    as not trained are left out."""
    out_dtype = DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    with TagTensors(ckpt_dir, tag, dtype=out_dtype, exclude_frozen=exclude_frozen) as tensors:
        out = _output_dir(out_dir, overwrite)
        stream = ((name, tensors.read(name)) for name in tensors.names())
        return write_model_files(out, tensors.specs, stream, max_shard_bytes=max_bytes,
                                 extra=render_hf_model_files(tensors.top.get("hf_files", {}),
                                                             out_dtype))

"""Whole-model weight files in the Hugging Face layout: ``model.safetensors``, or shards
``model-00001-of-00003.safetensors`` with ``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {name: file}}

Writing streams one tensor at a time; reading returns element ranges of flattened tensors,
so a rank reads only the rows that hold its fragments. Only safetensors (and the JSON index)
are accepted: anything else, pickles above all, is refused before it is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshzero.checkpoint.atomic import (
    commit_files,
    finish_journal,
    json_bytes,
    prepare_dir,
    write_temp,
    write_temp_bytes,
)
from meshzero.checkpoint.format import TensorSpec, read_flat, safetensors_fill

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_SUFFIX = ".index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def parse_size(size: str | int) -> int:
    """Bytes of ``"5GB"`` (10**9 per GB, as Hugging Face), ``"500MiB"``, ``"1024"`` or an int."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(size)
        unit = m[2].upper() if m else None
        if unit is not None and unit not in _UNITS and unit + "B" in _UNITS:
            unit += "B"  # "5G" means 5GB
        if not m or unit not in _UNITS:
            raise ValueError(f"size {size!r} is not a number of bytes like '5GB' or '500MiB'")
        value = int(float(m[1]) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Cut ``specs`` in order into shards of at most ``max_shard_bytes`` (a larger tensor
    gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and max_shard_bytes is not None and used + spec.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def shard_file_names(filename: str, count: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000N.safetensors`` ..."""
    stem = filename.removesuffix(".safetensors")
    return [filename] if count == 1 else [
        f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(out_dir: Path, filename: str, weight_map: dict[str, str], total_size: int
                ) -> str:
    """The temporary of the Hugging Face ``{filename}.index.json`` over shard files (see
    atomic.commit_files); returns its name."""
    name = filename + INDEX_SUFFIX
    data = json_bytes({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                      indent=2)
    write_temp(out_dir, name, lambda f: f.write(data))
    return name


def model_file_set(directory: Path, filename: str = WEIGHTS_NAME) -> list[str]:
    """The files of the model ``filename`` in ``directory``: itself, its index, its shards."""
    if not directory.is_dir():
        return []
    shard = re.compile(re.escape(filename.removesuffix(".safetensors"))
                       + r"-\d{5}-of-\d{5}\.safetensors")
    return sorted(p.name for p in directory.iterdir()
                  if p.name in (filename, filename + INDEX_SUFFIX) or shard.fullmatch(p.name))


def check_filename(filename: str, what: str = "filename") -> None:
    if not filename.endswith(".safetensors") or Path(filename).name != filename:
        raise ValueError(f"{what} {filename!r} must be a plain name ending in .safetensors")


def write_model_temps(out_dir: Path, specs: list[TensorSpec],
                      tensors: Iterable[tuple[str, torch.Tensor]], *,
                      max_shard_bytes: int | None = None, filename: str = WEIGHTS_NAME
                      ) -> list[str]:
    """Write ``tensors`` (yielded in the order of ``specs``) as temporaries of one file or of
    shards plus an index; returns their names. Memory: one tensor at a time."""
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(filename, len(shards))
    stream = iter(tensors)
    for name, shard in zip(names, shards, strict=True):
        take = (next(stream) for _ in shard)
        write_temp(out_dir, name, safetensors_fill(out_dir / name, shard, take,
                                                   metadata={"format": "pt"}))
    if len(shards) > 1:
        names.append(write_index(out_dir, filename, {
            s.name: n for n, shard in zip(names, shards, strict=True) for s in shard},
            sum(s.nbytes for s in specs)))
    return names


def write_model_files(
    out_dir: str | os.PathLike,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int | None = None,
    filename: str = WEIGHTS_NAME,
    extra: dict[str, bytes] | None = None,
) -> list[Path]:
    """Write a model (and ``extra`` files: config.json ...) into ``out_dir``, replacing the
    previous model of that name as a whole (atomic.commit_files): a kill at any point
    leaves the old files or the new ones. Returns the paths written."""
    check_filename(filename)
    out_dir = Path(out_dir)
    prepare_dir(out_dir)
    names = write_model_temps(out_dir, specs, tensors, max_shard_bytes=max_shard_bytes,
                              filename=filename)
    for name, data in (extra or {}).items():
        write_temp_bytes(out_dir, name, data)
    names += list(extra or {})
    stale = [n for n in model_file_set(out_dir, filename) if n not in names]
    paths = commit_files(out_dir, names, stale)
    logger.info("wrote %d file(s) to %s", len(paths), out_dir)
    return paths


# -- reading ---------------------------------------------------------------------------------
def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"refusing to load {path}: {why}. meshzero reads weights only from "
                      ".safetensors files (or their .index.json) and never unpickles; convert "
                      "pickled checkpoints (.bin/.pt/.pth/.ckpt) to safetensors first")


def _check_safetensors(path: Path) -> None:
    """Look at the header only: an 8-byte header length that fits, then ``{``, then a JSON
    header whose tensors end where the file ends (a truncated file is named here)."""
    if not path.is_file():
        raise ValueError(f"weights file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        if len(head) < 9:
            raise _refuse(path, "it is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len + 8 > size or head[8:9] != b"{":
            kind = "a pickle" if head[:1] == b"\x80" else (
                "a zip archive (torch.save)" if head[:2] == b"PK" else "not safetensors")
            raise _refuse(path, f"its content is {kind}")
        raw = head[8:] + f.read(header_len - 1)
    try:
        header = json.loads(raw)
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"weights file {path} has a damaged safetensors header: {exc}") from exc
    if 8 + header_len + end != size:
        raise ValueError(f"weights file {path} is truncated or damaged: its header describes "
                         f"{8 + header_len + end} bytes, the file has {size}")


def _open(path: Path) -> Any:
    """``safe_open`` of a checked file; an error names the file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors' own error type
        raise ValueError(f"weights file {path} cannot be read: {exc}") from exc


def resolve_weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` for a file, an index or a directory holding one."""
    path = Path(path)
    finish_journal(path if path.is_dir() else path.parent)  # a write killed half-way
    if path.is_dir():
        for candidate in (WEIGHTS_NAME + INDEX_SUFFIX, WEIGHTS_NAME):
            if (path / candidate).is_file():
                return resolve_weight_files(path / candidate)
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        raise _refuse(path, f"the directory holds no {WEIGHTS_NAME} or {WEIGHTS_NAME}"
                            f"{INDEX_SUFFIX}" + (f" (only {pickles})" if pickles else ""))
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a safetensors index (JSON with a weight_map): "
                             f"{exc}") from exc
        files = {}
        for name, file in weight_map.items():
            if Path(file).name != file or not file.endswith(".safetensors"):
                raise _refuse(path, f"its weight_map names {file!r}")
            files[name] = path.parent / file
        for file in set(files.values()):
            _check_safetensors(file)
        return files
    if path.suffix != ".safetensors":
        raise _refuse(path, f"{path.suffix or 'no suffix'} is not .safetensors")
    _check_safetensors(path)
    with _open(path) as f:
        return dict.fromkeys(f.keys(), path)


class WeightsReader:
    """Element ranges of the tensors of a model weight file (or index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = resolve_weight_files(path)
        self._handles: dict[Path, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, file in self.files.items():
            self.shapes[name] = tuple(self._handle(file).get_slice(name).get_shape())

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = _open(file)
        return self._handles[file]

    def names(self) -> Iterator[str]:
        return iter(self.files)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return read_flat(self._handle(self.files[name]), name, self.shapes[name], start, end)

    def read_whole(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)

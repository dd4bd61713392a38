"""The on-disk format of meshzero checkpoints and model files: safetensors and JSON only.

A checkpoint is one directory per tag::

    save_dir/
      latest                   the newest complete tag (written last, via os.replace)
      global_step100/
        manifest.json          everything needed to read the tag without the model
        rank00000.safetensors  rank 0's fragments, optimizer state and RNG state
        rank00001.safetensors  ...
        shared.safetensors     buffers (written once, by rank 0)

Rank files are named by data-parallel rank. With tensor or pipeline parallelism the tag holds
one such directory per (pp, tp) piece of the model, ``pp{p}_tp{t}/``, under a manifest that
names them (see checkpoint/mesh.py).

Tensor keys inside the rank files name what they hold, so reading needs no layout:

    "{param}|{start}:{end}|master"        fp32 values of elements [start, end) of the
                                           flattened parameter (frozen ones too)
    "{param}|{start}:{end}|optim.{kind}"  optimizer state of those elements (exp_avg, ...);
                                           0-dim state (Adam's step) is stored per fragment
    "{buffer}|buffer"                      a whole buffer
    "rng|{rank}|{source}"                  a rank's torch RNG state (uint8)

Nothing here unpickles: files are opened with ``safetensors.safe_open`` (or read as JSON), and
weight paths that are not safetensors are refused before they are opened for reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

FORMAT = "meshzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_FILE = "shared.safetensors"
_PIECE = re.compile(r"^(?P<name>[^|]+)\|(?P<start>\d+):(?P<end>\d+)\|(?P<kind>[^|]+)$")
_HASH_CHUNK = 1 << 22

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# -- keys ------------------------------------------------------------------------------------
def piece_key(name: str, start: int, end: int, kind: str) -> str:
    return f"{name}|{start}:{end}|{kind}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


# -- writing safetensors ---------------------------------------------------------------------
def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Stream tensors into a safetensors file; returns ``(bytes, sha256)`` of the file.

    The header is built from ``specs`` first, so only one tensor (on the CPU) is held at a
    time, and the file is hashed while it is written. ``tensors`` yields ``(name, tensor)`` in
    the order of ``specs``.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be stored in safetensors")
        header[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for spec, (name, tensor) in zip(specs, tensors, strict=True):
            if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not "
                                 f"match its header entry {spec}")
            data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
            f.write(data.data)
            digest.update(data.data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset, digest.hexdigest()


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())


def check_json(obj: Any, what: str) -> None:
    """ValueError unless ``obj`` is plain JSON (dicts, lists, str, numbers, bools, None)."""
    try:
        json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable (meshzero checkpoints hold no "
                         f"pickles): {exc}") from exc


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- tags and atomic commit ------------------------------------------------------------------
def check_tag(tag: str) -> None:
    if (not tag or tag in (".", "..", LATEST) or tag.startswith(".") or "/" in tag
            or os.sep in tag or "\0" in tag):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (not "
                         f"'latest', no path separators, not starting with '.')")


def tmp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".tmp-{tag}"


def prepare_tmp_dir(save_dir: Path, tag: str) -> None:
    """A fresh, empty ``.tmp-{tag}`` (a leftover of a crashed save is removed)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(save_dir, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def commit_tag(save_dir: Path, tag: str) -> Path:
    """Rename ``.tmp-{tag}`` to ``tag`` (replacing an older one), then point ``latest`` at it."""
    final = save_dir / tag
    old = save_dir / f".old-{tag}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp_dir(save_dir, tag).rename(final)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    write_latest(save_dir, tag)
    return final


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


def resolve_tag(directory: str | os.PathLike, tag: str | None) -> Path | None:
    """The tag directory to read; ``tag=None`` reads ``latest`` (None if there is none)."""
    directory = Path(directory)
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    check_tag(tag)
    return directory / tag


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory} is not a meshzero checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} version {VERSION} manifest")
    for entry in manifest["files"]:
        name = entry["name"]
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise ValueError(f"{path}: file entry {name!r} is not a .safetensors file name")
    return manifest


# -- reading ---------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: Path, nbytes: int, sha256: str) -> None:
    """ValueError naming the file and the checksum if it is missing, truncated or altered."""
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    got = sha256_file(path)
    if size != nbytes or got != sha256:
        raise ValueError(f"checkpoint file {path} fails its checksum: sha256 {got} "
                         f"({size} bytes), manifest says {sha256} ({nbytes} bytes); the file is "
                         "truncated or corrupted")


def read_flat(handle: Any, key: str, shape: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened tensor ``key``, reading only the rows that
    hold them (safetensors slices along the first dimension)."""
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:end]
    if len(shape) == 1:
        return handle.get_slice(key)[start:end]
    row = math.prod(shape[1:])
    if row == 0:
        return handle.get_slice(key)[0:0].reshape(-1)
    r0, r1 = start // row, -(-end // row)
    block = handle.get_slice(key)[r0:r1].reshape(-1)
    return block[start - r0 * row:end - r0 * row]


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    file: int
    key: str


class CheckpointReader:
    """Reads element ranges of a checkpoint tag, from whichever rank files hold them.

    A file is checked against the manifest's sha256 the first time it is needed
    (:meth:`verify` checks a set of files up front).
    """

    def __init__(self, directory: Path, manifest: dict):
        self.directory = directory
        self.manifest = manifest
        self.files = manifest["files"]
        self.pieces: dict[tuple[str, str], list[Piece]] = {}
        self.whole: dict[str, int] = {}
        for index, entry in enumerate(self.files):
            for key in entry["keys"]:
                m = _PIECE.match(key)
                if m:
                    piece = Piece(int(m["start"]), int(m["end"]), index, key)
                    self.pieces.setdefault((m["name"], m["kind"]), []).append(piece)
                else:
                    self.whole[key] = index
        for pieces in self.pieces.values():
            pieces.sort(key=lambda p: p.start)
        self._verified: set[int] = set()
        self._handles: dict[int, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.pieces

    def locate(self, name: str, kind: str, start: int, end: int) -> list[Piece]:
        """The saved pieces that cover ``[start, end)``; ValueError if any element is missing."""
        found, pos = [], start
        for p in self.pieces.get((name, kind), []):
            if p.end > pos and p.start <= pos < end:
                found.append(p)
                pos = p.end
        if pos < end and start < end:
            raise ValueError(f"{self.directory}: elements [{pos}, {end}) of {name!r} ({kind}) "
                             "are in no file of the checkpoint")
        return found

    def verify(self, files: Iterable[int]) -> None:
        for index in sorted(set(files) - self._verified):
            entry = self.files[index]
            verify_file(self.directory / entry["name"], entry["bytes"], entry["sha256"])
            self._verified.add(index)

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self.verify([index])
            path = self.directory / self.files[index]["name"]
            self._handles[index] = self._stack.enter_context(
                safe_open(str(path), framework="pt", device="cpu"))
        return self._handles[index]

    def read(self, name: str, kind: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``name``'s saved ``kind`` as one 1-D tensor."""
        parts = []
        for p in self.locate(name, kind, start, end):
            a, b = max(start, p.start), min(end, p.end)
            parts.append(self._handle(p.file).get_slice(p.key)[a - p.start:b - p.start])
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return torch.empty(0)
        return torch.cat(parts)

    def read_scalar(self, name: str, kind: str, start: int, end: int) -> torch.Tensor:
        """A 0-dim state saved per fragment: the value of the first piece that overlaps."""
        p = self.locate(name, kind, start, max(end, start + 1))[0]
        return self._handle(p.file).get_tensor(p.key)

    def file_of(self, key: str) -> int:
        """Index of the file holding the whole tensor ``key`` (a buffer or an RNG state)."""
        if key not in self.whole:
            raise ValueError(f"{self.directory}: tensor {key!r} is in no file of the checkpoint")
        return self.whole[key]

    def read_whole(self, key: str) -> torch.Tensor:
        return self._handle(self.file_of(key)).get_tensor(key)

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

``manifest.json`` carries ``manifest_sha256``, the sha256 of its own canonical JSON (older
manifests have none and are accepted). A save and its commit: see :func:`commit_tag`,
tags.py and docs/failures.md.

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
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import safe_open

from meshzero.checkpoint.atomic import (
    exchange,
    fs_step,
    fsync_dir,
    json_bytes,
    make_dir,
    naming,
    remove_tree,
    rename,
    write_atomic,
    write_in_place,
)

logger = logging.getLogger(__name__)

FORMAT = "meshzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_FILE = "shared.safetensors"
_PIECE = re.compile(r"^(?P<name>[^|]+)\|(?P<start>\d+):(?P<end>\d+)\|(?P<kind>[^|]+)$")
_HASH_CHUNK = 1 << 22
MANIFEST_SHA256 = "manifest_sha256"  # the manifest's own checksum (older versions: none)
MAX_TAG_BYTES = 250  # '.tmp-' + tag within a 255-byte directory name
# keys a manifest must hold, with their JSON types (see check_manifest_keys)
_TOP_KEYS: dict[str, Any] = {"files": list, "world_size": int, "stage": int, "steps": dict,
                             "client_state": object}
_PIECE_KEYS: dict[str, Any] = {
    "state_dict": list, "params": dict, "aliases": dict, "buffers": dict, "optimizer": dict,
    "scheduler": (dict, type(None)), "loss_scaler": dict, "rng": dict}
_NESTED = {"steps": ("global_steps", "micro_steps", "skipped_steps"),
           "optimizer": ("class", "param_groups", "state_kinds", "param_group_of",
                         "extra_state")}
_FILE_KEYS: dict[str, Any] = {"name": str, "bytes": int, "sha256": str, "keys": list}

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def storable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be written to safetensors by :func:`safetensors_fill`."""
    return dtype in _DTYPES


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
def safetensors_fill(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> Callable[[IO[bytes]], tuple[int, str]]:
    """A writer of the safetensors file ``path`` into an open file, for atomic.py; it
    returns ``(bytes, sha256)`` of the file.

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

    def fill(f: IO[bytes]) -> tuple[int, str]:
        digest = hashlib.sha256()
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        fs_step("data", path)
        for spec, (name, tensor) in zip(specs, tensors, strict=True):
            if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not "
                                 f"match its header entry {spec}")
            data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
            f.write(data.data)
            digest.update(data.data)
        return 8 + len(raw) + offset, digest.hexdigest()

    return fill


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Stream tensors into a new safetensors file inside a temporary tag directory (fsynced);
    returns ``(bytes, sha256)`` of the file."""
    return write_in_place(path, safetensors_fill(path, specs, tensors, metadata))


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    """A new JSON file inside a temporary directory, fsynced."""
    data = json_bytes(obj, indent)
    write_in_place(path, lambda f: f.write(data))


def check_json(obj: Any, what: str) -> None:
    """ValueError unless ``obj`` is plain JSON (dicts, lists, str, numbers, bools, None)."""
    try:
        json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable (meshzero checkpoints hold no "
                         f"pickles): {exc}") from exc


# -- tags and atomic commit ------------------------------------------------------------------
def check_tag(tag: str) -> None:
    if (not tag or tag in (".", "..", LATEST) or tag.startswith(".") or "/" in tag
            or os.sep in tag or "\0" in tag):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (not "
                         f"'latest', no path separators, not starting with '.')")
    if len(tag.encode()) > MAX_TAG_BYTES:
        raise ValueError(f"checkpoint tag {tag[:40]!r}... is {len(tag.encode())} bytes; at "
                         f"most {MAX_TAG_BYTES} fit a directory name beside '.tmp-'")


def tmp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".tmp-{tag}"


def old_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".old-{tag}"


def prepare_tmp_dir(save_dir: Path, tag: str) -> None:
    """A fresh, empty ``.tmp-{tag}`` (a leftover of a crashed save is removed)."""
    with naming(save_dir):
        save_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(save_dir, tag)
    remove_tree(tmp)
    make_dir(tmp)


def commit_tag(save_dir: Path, tag: str, directories: Sequence[Path] = (), *,
               latest: bool = True) -> Path:
    """Put the complete ``.tmp-{tag}`` in place as ``tag``, then point ``latest`` at it
    (``latest=False``: ``latest`` is left as it is). ``directories``: the subdirectories of
    the temporary tag, fsynced with it first.

    A re-save swaps the two directories in one step (atomic.exchange), so ``tag``, and
    ``latest`` naming it, are at every instant a complete checkpoint, the old or the new;
    the old copy, now ``.tmp-{tag}``, is removed last (a kill leaves it for recover_tags).
    Where the file system cannot swap, the old copy is moved to ``.old-{tag}`` first: a kill
    between the two renames leaves ``tag`` missing beside a complete ``.tmp-``/``.old-{tag}``,
    which tags.recover_tags puts back (docs/failures.md)."""
    tmp, final, old = tmp_dir(save_dir, tag), save_dir / tag, old_dir(save_dir, tag)
    for directory in (*directories, tmp):
        fsync_dir(directory)
    if final.exists() and exchange(tmp, final):
        old = tmp  # the old copy
    else:
        if final.exists():
            remove_tree(old)
            rename(final, old)
        rename(tmp, final)
    fsync_dir(save_dir)
    if latest:
        write_latest(save_dir, tag)
    remove_tree(old)
    return final


def write_latest(save_dir: Path, tag: str) -> None:
    write_atomic(save_dir / LATEST, lambda f: f.write(tag.encode()))


def resolve_tag(directory: str | os.PathLike, tag: str | None) -> Path | None:
    """The tag directory to read; ``tag=None`` reads ``latest`` (None if there is none)."""
    directory = Path(directory)
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
        check_tag(tag)
        if not (directory / tag).is_dir():
            raise ValueError(f"{latest} names tag {tag!r}, but {directory / tag} does not "
                             "exist; pass an existing tag")
    check_tag(tag)
    return directory / tag


# -- manifests -------------------------------------------------------------------------------
def manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), without its own
    ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    canonical = json.dumps(json.loads(json.dumps(body)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_manifest(path: Path, manifest: dict) -> None:
    """``manifest.json`` with its own checksum (a new file in the temporary tag)."""
    write_json(path, {**manifest, MANIFEST_SHA256: manifest_checksum(manifest)})


def read_manifest(directory: Path) -> dict:
    """The manifest of a tag (or piece) directory, checked: JSON, format and version, the
    keys a load needs, its own checksum (manifests of older versions have none)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory} is not a meshzero checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or manifest.get("version") != VERSION):
        raise ValueError(f"{path}: not a {FORMAT} version {VERSION} manifest")
    check_manifest_keys(manifest, path)
    want = manifest.get(MANIFEST_SHA256)
    if want is not None and want != manifest_checksum(manifest):
        raise ValueError(f"{path} fails its own checksum (manifest_sha256 {want}, content "
                         f"{manifest_checksum(manifest)}): the manifest was altered or damaged")
    for entry in manifest["files"]:
        name = entry["name"]
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise ValueError(f"{path}: file entry {name!r} is not a .safetensors file name")
    return manifest


def check_manifest_keys(manifest: dict, path: Path) -> None:
    """ValueError naming the first key (``a.b``) a load or consolidate needs and lacks."""
    required = dict(_TOP_KEYS, **(_PIECE_KEYS if "pieces" not in manifest else {"pieces": list}))
    for key, kind in required.items():
        _require(manifest, key, kind, path, key)
    for key, fields in _NESTED.items():
        if "pieces" in manifest and key != "steps":
            continue
        for field in fields:
            _require(manifest[key], field, object, path, f"{key}.{field}")
    for i, entry in enumerate(manifest["files"]):
        for field, kind in _FILE_KEYS.items():
            _require(entry, field, kind, path, f"files[{i}].{field}")
    for name, info in manifest.get("params", {}).items():
        _require(info, "shape", list, path, f"params[{name!r}].shape")
    for name, info in manifest.get("buffers", {}).items():
        _require(info, "shape", list, path, f"buffers[{name!r}].shape")
        _require(info, "dtype", str, path, f"buffers[{name!r}].dtype")


def _require(obj: Any, key: str, kind: Any, path: Path, where: str) -> None:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: the manifest lacks {where!r}; it is damaged or was not "
                         "written by meshzero")
    if kind is not object and not isinstance(obj[key], kind):
        raise ValueError(f"{path}: manifest entry {where!r} is a {type(obj[key]).__name__}, "
                         f"not a {getattr(kind, '__name__', kind)}")


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

    def check_extents(self, params: dict) -> None:
        """ValueError unless each parameter's saved values hold exactly the elements of its
        manifest shape (a manifest without a checksum may have been edited)."""
        for name, info in params.items():
            pieces = self.pieces.get((name, "master"))
            numel = math.prod(info["shape"])
            if pieces and max(p.end for p in pieces) != numel:
                raise ValueError(
                    f"{self.directory / MANIFEST}: parameter {name!r} has shape {info['shape']} "
                    f"({numel} elements) but the checkpoint holds {max(p.end for p in pieces)} "
                    "elements of it: the manifest was altered")

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

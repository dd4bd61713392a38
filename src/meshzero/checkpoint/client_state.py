"""``client_state`` of a checkpoint, without pickle: tensors and numpy arrays go into
``client_state.safetensors`` beside the manifest, everything else into the manifest's JSON.

Plain JSON (dicts with string keys, lists, str, int, float, bool, None) is stored as it is.
Anything else is a one-key object ``{"__meshzero__": kind, ...}`` that decodes back to the
same type::

    tensor          {"key", "device", "parameter", "requires_grad"}: the values in the file
    ndarray         {"key", "dtype", "shape"}: the array's bytes (any numeric dtype) in the file
    numpy_scalar    {"dtype", "hex"}: np.float32(1.5), np.int64(3), ... bit-exact
    tuple, set, frozenset, list-like  {"items"}
    dict            {"items": [[key, value], ...]}: non-string keys (or the tag's own key)
    ordered_dict    {"items"}
    namespace       {"attrs"}: an argparse.Namespace
    path            {"class", "path"}: pathlib paths
    bytes           {"hex"}
    torch_dtype, torch_device, torch_size, complex, slice, range
    defaultdict     {"factory", "items"}: with a builtin default_factory (int, list, ...)
    dataclass, enum, namedtuple, mapping (a dict subclass: Lightning's AttributeDict)
                    {"class", ...}: decoded only when the class's module is already imported

A value none of these cover (a function, a lock, a module, an open file, an object tensor)
raises ValueError naming its key path (``client_state['opt']['fn']``) before anything is
written. Nothing is imported or executed by a load: a dataclass or enum is rebuilt only from
a class already in ``sys.modules``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import logging
import math
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from meshzero.checkpoint.format import TensorSpec, dtype_from_name, dtype_name, storable

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

TAG = "__meshzero__"
ENCODING = 1  # the manifest's "client_state_encoding" (absent: plain JSON, older checkpoints)
FILE = "client_state.safetensors"
KEY_PREFIX = "client_state|"
_SEQUENCES: dict[type, str] = {tuple: "tuple", set: "set", frozenset: "frozenset"}
_FACTORIES: dict[str, type] = {t.__name__: t for t in (int, float, str, bool, list, dict, set,
                                                      tuple)}
_PATHS = {cls.__name__: cls for cls in (pathlib.Path, pathlib.PurePath, pathlib.PurePosixPath,
                                         pathlib.PureWindowsPath, pathlib.PosixPath,
                                         pathlib.WindowsPath)}


@dataclass
class Encoded:
    """``client_state`` as JSON plus the tensors that go into :data:`FILE`."""

    json: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in self.tensors.items()]


def encode(value: Any, where: str = "client_state") -> Encoded:
    """``value`` as JSON with tagged objects, and its tensors; ValueError naming the key
    path of the first value that cannot be saved."""
    out = Encoded(None)
    out.json = _Encoder(out.tensors).encode(value, where)
    return out


class _Encoder:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.keys: dict[int, str] = {}  # id(tensor) -> key: one tensor saved once

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            return self._numpy(value, where)
        if type(value) is list:
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is dict:
            return self._dict(value, where)
        return self._object(value, where)

    def _dict(self, value: dict, where: str) -> Any:
        if all(isinstance(k, str) and k != TAG for k in value):
            return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {TAG: "dict", "items": self._items(value, where)}

    def _items(self, value: dict, where: str) -> list:
        return [[self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                for k, v in value.items()]

    def _object(self, value: Any, where: str) -> Any:
        cls = type(value)
        if cls in _SEQUENCES:
            return {TAG: _SEQUENCES[cls],
                    "items": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if cls is collections.OrderedDict:
            return {TAG: "ordered_dict", "items": self._items(value, where)}
        if isinstance(value, argparse.Namespace) and cls is argparse.Namespace:
            attrs = vars(value)
            return {TAG: "namespace",
                    "attrs": {k: self.encode(v, f"{where}.{k}") for k, v in attrs.items()}}
        if isinstance(value, pathlib.PurePath) and cls.__name__ in _PATHS:
            return {TAG: "path", "class": cls.__name__, "path": str(value)}
        if isinstance(value, enum.Enum):
            return {TAG: "enum", "class": _class_name(cls),
                    "value": self.encode(value.value, f"{where}.value")}
        simple = _simple(value)
        if simple is not None:
            return simple
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: self.encode(getattr(value, f.name), f"{where}.{f.name}")
                      for f in dataclasses.fields(value) if f.init}
            return {TAG: "dataclass", "class": _class_name(cls), "fields": fields}
        if isinstance(value, dict):
            return self._mapping(value, where)
        if isinstance(value, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
            fields = {f: self.encode(getattr(value, f), f"{where}.{f}") for f in cls._fields}
            return {TAG: "namedtuple", "class": _class_name(cls), "fields": fields}
        raise ValueError(f"{where}: {_describe(value)} cannot be saved in a checkpoint "
                         "(meshzero checkpoints hold no pickles: client_state may hold tensors, "
                         "numpy arrays, argparse.Namespace, dataclasses, enums, namedtuples, "
                         "paths and plain JSON values in dicts, lists, tuples and sets); "
                         "convert it first")

    def _mapping(self, value: dict, where: str) -> dict:
        """A dict subclass: a defaultdict with a builtin factory, or a class whose state is
        its items (Lightning's AttributeDict, ...)."""
        cls = type(value)
        if isinstance(value, collections.defaultdict):
            factory = value.default_factory
            if factory is not None and _FACTORIES.get(getattr(factory, "__name__", "")) \
                    is not factory:
                raise ValueError(f"{where}: a defaultdict whose default_factory is "
                                 f"{_describe(factory)} cannot be saved in a checkpoint (only "
                                 f"{sorted(_FACTORIES)} can); convert it to a dict first")
            return {TAG: "defaultdict", "factory": factory and factory.__name__,
                    "items": self._items(value, where)}
        if getattr(value, "__dict__", None):
            raise ValueError(f"{where}: {_describe(value)} (a dict with attributes of its own: "
                             f"{sorted(vars(value))}) cannot be saved in a checkpoint; convert "
                             "it to a dict first")
        return {TAG: "mapping", "class": _class_name(cls), "items": self._items(value, where)}

    def _tensor(self, t: torch.Tensor, where: str) -> dict:
        if t.layout != torch.strided or t.is_quantized or t.is_complex():
            raise ValueError(f"{where}: a {t.layout} {t.dtype} tensor cannot be saved in "
                             "safetensors; convert it to a dense real tensor first")
        if id(t) not in self.keys:
            if not storable(t.dtype):
                raise ValueError(f"{where}: tensor dtype {t.dtype} cannot be stored in "
                                 "safetensors; convert it first")
            key = f"{KEY_PREFIX}{len(self.tensors)}"
            self.keys[id(t)] = key
            self.tensors[key] = t.detach()
        return {TAG: "tensor", "key": self.keys[id(t)], "device": t.device.type,
                "parameter": isinstance(t, torch.nn.Parameter),
                "requires_grad": t.requires_grad}

    def _numpy(self, value: Any, where: str) -> dict:
        assert np is not None
        if value.dtype.hasobject or value.dtype.fields is not None:
            raise ValueError(f"{where}: a numpy array of dtype {value.dtype} (objects or "
                             "records) cannot be saved without pickle; convert it first")
        if isinstance(value, np.generic):
            return {TAG: "numpy_scalar", "dtype": value.dtype.str, "hex": value.tobytes().hex()}
        key = f"{KEY_PREFIX}{len(self.tensors)}"
        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        self.tensors[key] = torch.from_numpy(raw.copy())
        return {TAG: "ndarray", "key": key, "dtype": value.dtype.str, "shape": list(value.shape)}


def _simple(value: Any) -> Any:
    """The tagged form of the small immutable types (an int or float subclass: its plain
    value), or None."""
    if isinstance(value, int):  # bool and int themselves never come here; enums are done
        return int(value)
    if isinstance(value, float):
        return {TAG: "float", "value": repr(float(value))}
    if isinstance(value, torch.dtype):
        return {TAG: "torch_dtype", "name": dtype_name(value)}
    if isinstance(value, torch.device):
        return {TAG: "torch_device", "name": str(value)}
    if isinstance(value, torch.Size):
        return {TAG: "torch_size", "items": list(value)}
    if isinstance(value, bytes | bytearray):
        return {TAG: "bytes", "hex": bytes(value).hex(), "bytearray": type(value) is bytearray}
    if type(value) is complex:
        return {TAG: "complex", "real": repr(value.real), "imag": repr(value.imag)}
    if type(value) is range:
        return {TAG: "range", "args": [value.start, value.stop, value.step]}
    return None


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"a class ({value.__qualname__})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"a function ({value.__qualname__})"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


# -- decoding --------------------------------------------------------------------------------
def decode(value: Any, tensors: dict[str, torch.Tensor], device: torch.device | None = None
           ) -> Any:
    """The object :func:`encode` saved; ``tensors`` are the file's tensors (on the CPU),
    moved to ``device`` when they were saved from an accelerator."""
    return _Decoder(tensors, device).decode(value)


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device | None):
        self.tensors = tensors
        self.device = device
        self.done: dict[str, torch.Tensor] = {}

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if TAG not in value:
            return {k: self.decode(v) for k, v in value.items()}
        kind = value[TAG]
        if kind in ("tuple", "set", "frozenset"):
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](
                self.decode(v) for v in value["items"])
        if kind in ("dict", "ordered_dict"):
            cls = dict if kind == "dict" else collections.OrderedDict
            return cls((self._key(k), self.decode(v)) for k, v in value["items"])
        if kind == "namespace":
            return argparse.Namespace(**{k: self.decode(v) for k, v in value["attrs"].items()})
        if kind == "tensor":
            return self._tensor(value)
        if kind == "ndarray":
            return self._ndarray(value)
        if kind == "defaultdict":
            factory = _FACTORIES[value["factory"]] if value["factory"] else None
            return collections.defaultdict(factory, ((self._key(k), self.decode(v))
                                                     for k, v in value["items"]))
        if kind in ("dataclass", "enum", "mapping", "namedtuple"):
            return self._class_instance(value)
        return _decode_simple(value)

    def _key(self, key: Any) -> Any:
        out = self.decode(key)
        return tuple(out) if isinstance(out, list) else out

    def _tensor(self, value: dict) -> torch.Tensor:
        key = value["key"]
        if key not in self.done:
            t = self.tensors[key]
            if value["device"] != "cpu" and self.device is not None \
                    and self.device.type == value["device"]:
                t = t.to(self.device)
            if value["parameter"]:
                t = torch.nn.Parameter(t, requires_grad=value["requires_grad"])
            elif value["requires_grad"]:
                t = t.requires_grad_(True)
            self.done[key] = t
        return self.done[key]

    def _ndarray(self, value: dict) -> Any:
        if np is None:  # pragma: no cover
            raise ValueError("client_state holds a numpy array and numpy is not installed")
        raw = self.tensors[value["key"]].numpy()
        return raw.view(np.dtype(value["dtype"])).reshape(value["shape"]).copy()

    def _class_instance(self, value: dict) -> Any:
        kind, cls = value[TAG], _imported_class(value)
        if kind == "enum":
            return cls(self.decode(value["value"]))
        if kind == "mapping" and issubclass(cls, dict):
            return cls((self._key(k), self.decode(v)) for k, v in value["items"])
        if kind in ("dataclass", "namedtuple"):
            return cls(**{k: self.decode(v) for k, v in value["fields"].items()})
        raise ValueError(f"client_state holds a {kind} of class {value['class']}, which is "
                         f"not one in this process (it is a {cls.__qualname__})")


def _imported_class(value: dict) -> type:
    """The class ``value["class"]`` names, from a module already imported (a load imports
    nothing: importing runs code)."""
    module_name, _, qualname = value["class"].partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise ValueError(f"client_state holds a {value[TAG]} of class {value['class']}, "
                         f"which is not defined in this process: import {module_name} "
                         "before loading the checkpoint (a load imports nothing)")
    return obj


def _decode_simple(value: dict) -> Any:
    kind = value[TAG]
    if kind == "float":
        return float(value["value"])
    if kind == "numpy_scalar":
        assert np is not None
        return np.frombuffer(bytes.fromhex(value["hex"]), dtype=np.dtype(value["dtype"]))[0]
    if kind == "path":
        return _PATHS[value["class"]](value["path"])
    if kind == "torch_dtype":
        return dtype_from_name(value["name"])
    if kind == "torch_device":
        return torch.device(value["name"])
    if kind == "torch_size":
        return torch.Size(value["items"])
    if kind == "bytes":
        raw = bytes.fromhex(value["hex"])
        return bytearray(raw) if value["bytearray"] else raw
    if kind == "complex":
        return complex(float(value["real"]), float(value["imag"]))
    if kind == "range":
        return range(*value["args"])
    raise ValueError(f"client_state holds an object tagged {kind!r}, which this meshzero "
                     "version cannot read (saved by a newer one?)")

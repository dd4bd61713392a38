"""The model an estimate is about, built on the meta device (no memory for its parameters).

Sources:
    "pkg.mod:factory"   a zero-argument callable returning an nn.Module, called under
                        ``with torch.device("meta")``
    "path/config.json"  a Hugging Face config (needs ``transformers``), built with
                        ``from_config`` on the meta device: no weights are read
    params=N, largest_unit=L   no model: N parameters in units of at most L
    an nn.Module or a zero-argument callable (Python API)

Parameters are counted from the meta tensors' shapes, so a model far larger than this
machine's memory is counted exactly (shared parameters once), and its layout comes from the
engine's own ``build_layout``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshzero.profiling.report import si
from meshzero.zero.units import Layout, build_layout

SEQ_LEN_ATTRS = ("block_size", "n_positions", "max_position_embeddings", "max_seq_len",
                 "seq_len", "n_ctx")
MAX_SYNTHETIC_UNITS = 100_000

# inputs(micro_batch, seq_len) -> the model's forward arguments: a tensor, a tuple or a dict
InputsFn = Callable[[int, int | None], Any]


@dataclass
class ModelSpec:
    """A model on the meta device (or None for a parameter count) and how to feed it."""

    name: str
    model: nn.Module
    kind: str  # "module", "hf" or "params"
    inputs: InputsFn | None = None
    default_seq_len: int | None = None
    input_model: nn.Module | None = None  # what decides the inputs, if not ``model`` (a
    # tensor/pipeline-parallel cut of it takes the whole model's inputs)
    _layouts: dict[tuple, Layout] = field(default_factory=dict, repr=False)

    @property
    def num_params(self) -> int:
        """Parameters of the model, each shared tensor once."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def runnable(self) -> bool:
        """Whether a forward/backward can be run (not for a bare parameter count)."""
        return self.kind != "params"

    def layout(self, num_shards: int, *, stage: int, persistence_threshold: int,
               unit_classes: tuple[str, ...] | None) -> Layout:
        """The engine's layout for ``num_shards`` ranks (persistence applies at stage 3)."""
        key = (num_shards, persistence_threshold if stage == 3 else None, unit_classes)
        if key not in self._layouts:
            self._layouts[key] = build_layout(
                self.model, num_shards=num_shards,
                unit_classes=list(unit_classes) if unit_classes is not None else None,
                persistence_threshold=key[1])
        return self._layouts[key]


def load_model(source: str | nn.Module | Callable[[], nn.Module] | None = None, *,
               params: int | str | None = None, largest_unit: int | str | None = None,
               inputs: InputsFn | str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from any of the sources in the module docstring."""
    make_inputs: InputsFn | None = (import_object(inputs, "inputs") if isinstance(inputs, str)
                                     else inputs)
    if source is None:
        if params is None:
            raise ValueError("no model: give an import path 'pkg.mod:factory', a Hugging Face "
                             "config.json, or --params N (with --largest-unit L)")
        return synthetic_model(parse_count(params, "params"),
                               parse_count(largest_unit, "largest unit")
                               if largest_unit is not None else None)
    if params is not None or largest_unit is not None:
        raise ValueError("give either a model or --params/--largest-unit, not both")
    if isinstance(source, nn.Module):
        return ModelSpec(type(source).__name__, source, "module", make_inputs,
                         default_seq_len(source))
    if callable(source):
        model = _build(source, getattr(source, "__name__", repr(source)))
        return ModelSpec(getattr(source, "__name__", repr(source)), model, "module", make_inputs,
                         default_seq_len(model))
    if not isinstance(source, str):
        raise ValueError(f"model must be an import path, a config.json path, an nn.Module or "
                         f"a callable; got {type(source).__name__}")
    path = Path(source)
    if source.endswith(".json") or path.is_dir():
        return hf_model(path, make_inputs)
    factory = import_object(source, "model factory")
    model = _build(factory, source)
    return ModelSpec(source, model, "module", make_inputs, default_seq_len(model))


def import_object(spec: str, what: str) -> Any:
    """``pkg.mod:name`` -> the object, with a clear error for each way it can fail."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} is not an import path of the form 'pkg.mod:name' "
                         "(or a path to a Hugging Face config.json)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def _build(factory: Callable[[], Any], name: str) -> nn.Module:
    """Call ``factory()`` on the meta device: parameters get shapes, no memory."""
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise ValueError(f"model factory {name!r} must be callable with no arguments: "
                         f"{exc}") from None
    except ValueError:  # no signature to inspect (some builtins): just call it
        pass
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {name!r} returned a {type(model).__name__}, "
                         "not an nn.Module")
    return model


def context_length(model: nn.Module) -> tuple[str, int] | None:
    """``(attribute, value)`` of the model's context length if its config says
    (block_size, n_positions, max_position_embeddings...)."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None), model):
        for attr in SEQ_LEN_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return attr, value
    return None


def default_seq_len(model: nn.Module) -> int | None:
    """The model's context length if its config says (see :func:`context_length`)."""
    found = context_length(model)
    return found[1] if found else None


def check_seq_len(spec: ModelSpec, seq_len: int | None) -> str | None:
    """Refuse a ``seq_len`` longer than a learned position table (an embedding with as many
    rows as the context length: a real forward indexes past it and raises; fake tensors would
    not). Beyond a context length with no such table (rotary positions) the model runs:
    returns a note instead."""
    model = spec.input_model or spec.model  # the whole model, where a cut is estimated
    found = context_length(model)
    if seq_len is None or found is None or seq_len <= found[1]:
        return None
    attr, limit = found
    if any(isinstance(m, nn.Embedding) and m.num_embeddings == limit for m in model.modules()):
        raise ValueError(f"seq_len {seq_len} is longer than the model's {attr} = {limit}: its "
                         f"position embedding has {limit} rows, so a forward would fail; give "
                         f"a seq_len of at most {limit}")
    return (f"seq_len {seq_len} is longer than the model's {attr} = {limit} (positions are "
            "not a learned table, so it runs, beyond the length the model was trained to)")


# -- Hugging Face --------------------------------------------------------------------------


def hf_model(path: Path, inputs: InputsFn | None) -> ModelSpec:
    """A ``transformers`` model from its config.json (or a directory holding one), on meta."""
    file = path / "config.json" if path.is_dir() else path
    try:
        text = file.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read Hugging Face config {str(file)!r}: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Hugging Face config {str(file)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"Hugging Face config {str(file)!r} must be a JSON object with a "
                         "'model_type' (e.g. \"llama\", \"gpt2\")")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"reading the Hugging Face config {str(file)!r} needs the "
                         "'transformers' package: pip install transformers") from None
    model_type = raw.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"Hugging Face config {str(file)!r}: {exc}") from None
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the base model
            model = transformers.AutoModel.from_config(config)
    model.train()
    return ModelSpec(str(file), model, "hf", inputs, default_seq_len(model))


# -- a bare parameter count ------------------------------------------------------------------


class _Unit(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel))


class _ParameterCount(nn.Module):
    """``params`` elements in units of ``largest_unit``: the layout of a repeated-block model."""

    def __init__(self, params: int, largest_unit: int):
        super().__init__()
        full, rest = divmod(params, largest_unit)
        sizes = [largest_unit] * full + ([rest] if rest else [])
        self.units = nn.ModuleList(_Unit(n) for n in sizes)


def synthetic_model(params: int, largest_unit: int | None) -> ModelSpec:
    largest = params if largest_unit is None else largest_unit
    if largest > params:
        raise ValueError(f"largest unit ({largest}) is larger than the model ({params} params)")
    if math.ceil(params / largest) > MAX_SYNTHETIC_UNITS:
        raise ValueError(f"{params} params in units of {largest} make more than "
                         f"{MAX_SYNTHETIC_UNITS} units; give a realistic --largest-unit (a "
                         "transformer block is typically 1-3 % of the model)")
    with torch.device("meta"):
        model = _ParameterCount(params, largest)
    return ModelSpec(f"--params {si(params)} --largest-unit {si(largest)}", model, "params")


_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(value: int | str, what: str) -> int:
    """``7000000``, ``"7e9"``, ``"7B"``, ``"350M"`` -> a positive int."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        text = str(value).strip().upper()
        suffix = text[-1] if text and text[-1] in _COUNT_SUFFIX else ""
        try:
            number = int(float(text[:len(text) - len(suffix)]) * _COUNT_SUFFIX[suffix])
        except ValueError:
            raise ValueError(f"{what} {value!r} is not a count like 7e9, 7B or 350M") from None
    if number < 1:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return number

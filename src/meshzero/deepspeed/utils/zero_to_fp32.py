# ruff: noqa: E501 - the first docstring lines carry DeepSpeed's full dotted names
"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over meshzero checkpoints: the full fp32
weights of a tag saved by ``engine.save_checkpoint``, read in one process without a process
group or the model (meshzero.checkpoint.TagTensors, the reader of ``meshzero consolidate``).

A meshzero checkpoint at any stage, data-parallel size, tensor and pipeline parallel size
reads the same way (DeepSpeed's reads ZeRO 2 and 3 layouts). Nothing is pickled:
``convert_zero_checkpoint_to_fp32_state_dict`` writes safetensors whatever
``safe_serialization`` says. Run as a script, as DeepSpeed's copy in a checkpoint is::

    python -m meshzero.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG]
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from torch import nn

from meshzero.checkpoint import TagTensors, consolidate

logger = logging.getLogger(__name__)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_NO_SHARDING = 1 << 62  # max_shard_size=None: one file


class GatheredTensor:
    """DeepSpeed's `deepspeed.utils.zero_to_fp32.GatheredTensor`: a lazy_mode value, read by contiguous().

    One tensor of a checkpoint; ``shape`` and ``dtype`` are known up front."""

    def __init__(self, tensors: TagTensors, name: str):
        self._tensors = tensors
        self._name = name
        spec = tensors.spec(name)
        self.shape = torch.Size(spec.shape)
        self.dtype = spec.dtype

    def contiguous(self) -> torch.Tensor:
        """DeepSpeed's `deepspeed.utils.zero_to_fp32.GatheredTensor.contiguous`: the tensor, read."""
        return self._tensors.read(self._name)

    def __repr__(self) -> str:
        return f"GatheredTensor({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _tag_tensors(checkpoint_dir: str | os.PathLike, tag: str | None,
                 exclude_frozen_parameters: bool) -> TagTensors:
    if tag is not None and not (Path(checkpoint_dir) / str(tag)).is_dir():
        raise FileNotFoundError(f"Directory '{Path(checkpoint_dir) / str(tag)}' doesn't exist")
    return TagTensors(checkpoint_dir, None if tag is None else str(tag),
                      exclude_frozen=exclude_frozen_parameters)


def get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir: str | os.PathLike, tag: str | None = None,
        exclude_frozen_parameters: bool = False, lazy_mode: bool = False) -> dict:
    """DeepSpeed's `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`: a checkpoint's full fp32 weights, one process.

    ``{state_dict name: full fp32 CPU tensor}`` of the tag ``tag`` (default: the one
    ``latest`` names) under ``checkpoint_dir`` (the ``save_dir`` given to
    ``engine.save_checkpoint``), buffers included; tied names share one tensor.
    ``exclude_frozen_parameters`` leaves out the parameters that were not trained.
    ``lazy_mode``: the values are :class:`GatheredTensor` objects whose ``contiguous()`` reads
    the tensor (the files stay open while any of them is alive).
    """
    tensors = _tag_tensors(checkpoint_dir, tag, exclude_frozen_parameters)
    shared: dict[tuple, object] = {}  # one value per stored tensor: tied names share it
    out: dict = {}
    try:
        for name in tensors.names():
            source = tensors.source(name)
            if source not in shared:
                shared[source] = GatheredTensor(tensors, name) if lazy_mode else tensors.read(name)
            out[name] = shared[source]
    finally:
        if lazy_mode:
            tensors.close_when_collected()
        else:
            tensors.close()
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
        max_shard_size: str | int | None = "5GB", safe_serialization: bool = False,
        tag: str | None = None, exclude_frozen_parameters: bool = False) -> list[Path]:
    """DeepSpeed's `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict`: ``meshzero consolidate`` to fp32 safetensors.

    Writes the tag's fp32 weights into ``output_dir`` as ``model.safetensors`` (above
    ``max_shard_size``: ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``; ``None``: one file), replacing a model already there
    as DeepSpeed does. Always safetensors, never pickle: ``safe_serialization=False`` (where
    DeepSpeed writes ``pytorch_model.bin``) says so in one warning. Returns the files.
    """
    if not safe_serialization:
        logger.warning("convert_zero_checkpoint_to_fp32_state_dict: safe_serialization=False "
                       "writes model.safetensors anyway (meshzero never writes pickles; load "
                       "it with safetensors.torch.load_file)")
    if tag is not None and not (Path(checkpoint_dir) / str(tag)).is_dir():
        raise FileNotFoundError(f"Directory '{Path(checkpoint_dir) / str(tag)}' doesn't exist")
    return consolidate(checkpoint_dir, output_dir, tag=None if tag is None else str(tag),
                       dtype="fp32",
                       max_shard_size=_NO_SHARDING if max_shard_size is None else max_shard_size,
                       overwrite=True, exclude_frozen=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """DeepSpeed's `deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint`: a checkpoint's fp32 weights into a plain model.

    Moves ``model`` (a plain ``nn.Module``, not an engine) to the CPU and loads the tag's
    fp32 weights into it with ``strict=False``, as DeepSpeed does (one INFO line names the
    missing and unexpected keys, if any); returns the model.
    """
    from meshzero.engine import Engine

    if isinstance(model, Engine):
        raise ValueError("load_state_dict_from_zero_checkpoint takes the plain model, not an "
                         "engine: use engine.load_checkpoint(checkpoint_dir) to load into an "
                         "engine")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        logger.info("load_state_dict_from_zero_checkpoint (strict=False): missing %s, "
                    "unexpected %s", result.missing_keys, result.unexpected_keys)
    return model


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's `deepspeed.utils.zero_to_fp32` as a script: CHECKPOINT_DIR OUTPUT_DIR, same flags."""
    parser = argparse.ArgumentParser(description="a meshzero checkpoint's fp32 weights as "
                                                 "safetensors")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="accepted; the output is safetensors either way")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    args = parser.parse_args(argv)
    for path in convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=True, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The JSON files that make a weights directory a ``from_pretrained`` directory.

A Hugging Face model carries its ``config`` (and, for generative models, a
``generation_config``). ``save_16bit_model`` writes them next to the weights; a sharded
checkpoint stores them in its manifest so ``meshzero consolidate`` can write them too, with
no model and no transformers at hand. Duck-typed (``to_json_string``): importing this module
never imports transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def hf_model_files(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{file name: JSON object}`` for ``module``'s Hugging Face configs; empty when it is not
    a Hugging Face model. The class name goes in ``architectures`` as ``save_pretrained``
    does, so ``AutoModelFor*`` picks the same head."""
    files: dict[str, dict[str, Any]] = {}
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return files
    files[CONFIG_NAME] = json.loads(config.to_json_string(use_diff=True))
    files[CONFIG_NAME]["architectures"] = [type(module).__name__]
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(getattr(generation, "to_json_string", None)):
        files[GENERATION_CONFIG_NAME] = json.loads(generation.to_json_string(use_diff=True))
    return files


def render_hf_model_files(files: dict[str, dict[str, Any]], dtype: torch.dtype | None = None
                          ) -> dict[str, bytes]:
    """``{file name: content}`` of ``files`` (from :func:`hf_model_files`); ``dtype`` is the
    dtype of the weights written beside them, recorded in config.json for ``dtype="auto"``."""
    out = {}
    for name, obj in files.items():
        if name not in (CONFIG_NAME, GENERATION_CONFIG_NAME):
            raise ValueError(f"unexpected Hugging Face file {name!r} in checkpoint metadata")
        if name == CONFIG_NAME and dtype is not None:
            obj = {**obj, "dtype": str(dtype).removeprefix("torch.")}
        out[name] = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    return out


def write_hf_model_files(out_dir: str | os.PathLike, files: dict[str, dict[str, Any]],
                         dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``files`` under ``out_dir`` (meshzero's own writers commit them with the
    weights instead, see checkpoint/atomic.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in render_hf_model_files(files, dtype).items():
        (out / name).write_bytes(data)
        written.append(out / name)
    return written

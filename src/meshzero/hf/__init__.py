"""Hugging Face integration: :class:`MeshzeroTrainer`, a drop-in ``transformers.Trainer``.

``meshzero.hf.files`` (config.json beside saved weights) needs no transformers; the Trainer
is imported on first use, so ``import meshzero.hf`` does not import transformers either.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MeshzeroTrainer"]


def __getattr__(name: str) -> Any:
    if name == "MeshzeroTrainer":
        from meshzero.hf.trainer import MeshzeroTrainer

        return MeshzeroTrainer
    raise AttributeError(f"module 'meshzero.hf' has no attribute {name!r}")

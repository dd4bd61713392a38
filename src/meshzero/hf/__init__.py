"""Hugging Face integration: :class:`MeshzeroTrainer`, a drop-in ``transformers.Trainer``;
``on_meshzero(cls)`` for any Trainer subclass (TRL's); ``save_pretrained(engine, dir)``.

``meshzero.hf.files`` (config.json beside saved weights) needs no transformers; the Trainer
is imported on first use, so ``import meshzero.hf`` does not import transformers either.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MeshzeroTrainer", "on_meshzero", "save_pretrained"]


def __getattr__(name: str) -> Any:
    if name == "MeshzeroTrainer":
        from meshzero.hf.trainer import MeshzeroTrainer

        return MeshzeroTrainer
    if name == "on_meshzero":
        from meshzero.hf.compose import on_meshzero

        return on_meshzero
    if name == "save_pretrained":
        from meshzero.hf.save import save_pretrained

        return save_pretrained
    raise AttributeError(f"module 'meshzero.hf' has no attribute {name!r}")

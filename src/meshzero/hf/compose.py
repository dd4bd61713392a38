"""``on_meshzero(TrainerSubclass)``: any ``transformers.Trainer`` subclass on meshzero.

    from trl import DPOTrainer
    from meshzero.hf import on_meshzero

    trainer = on_meshzero(DPOTrainer)(model=..., args=..., train_dataset=...,
                                      processing_class=tok, meshzero_config="ds_config.json")

The composed class is ``class MeshzeroDPOTrainer(DPOTrainer, MeshzeroTrainer)``: the
subclass comes first, so its own ``training_step``, ``compute_loss`` and ``_prepare_inputs``
(TRL's losses, GRPO's generation and step counter) wrap meshzero's, which call the engine.
``meshzero_config`` is taken out of the keywords (and kept) before the subclass's ``__init__``
runs, so the subclass may take any keywords of its own and call ``super().__init__`` with
whichever it likes. The class is made once per subclass (the same object each call).
"""

from __future__ import annotations

import functools
import os
from typing import Any

try:
    from transformers import Trainer
except ImportError as e:  # an extra: say which, rather than a bare ModuleNotFoundError
    raise ImportError("meshzero.hf.on_meshzero needs transformers: "
                      "pip install 'meshzero[hf]'") from e

from meshzero.hf.config import read_raw_config
from meshzero.hf.trainer import MeshzeroTrainer

SUPPORTED_TRL = ">=1.14,<2"  # pyproject's trl extra; 1.14.0 and 1.16.0 tested
OLDEST_TRL = (1, 14)


def check_trl(trainer_cls: type) -> None:
    """A TRL trainer class from a release older than ``SUPPORTED_TRL`` is refused, naming it
    (trl 1.12 and older look for PEFT on the engine, not the model: DPO loses its reference)."""
    if not trainer_cls.__module__.startswith("trl."):
        return
    try:
        import trl
    except ImportError as e:  # a TRL class without trl importable: an extra, say which
        raise ImportError("meshzero.hf.on_meshzero needs trl for a TRL trainer: "
                          "pip install 'meshzero[trl]'") from e

    parts = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    if parts < OLDEST_TRL:
        raise ImportError(f"meshzero.hf.on_meshzero supports trl{SUPPORTED_TRL}; trl "
                          f"{trl.__version__} is installed: pip install 'trl{SUPPORTED_TRL}' "
                          "(or pip install 'meshzero[trl]')")


@functools.cache
def on_meshzero(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with
    meshzero's engine under its loop; it takes one more keyword, ``meshzero_config``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"on_meshzero takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, MeshzeroTrainer):
        return trainer_cls
    if trainer_cls is Trainer:
        return MeshzeroTrainer
    check_trl(trainer_cls)

    def __init__(self: Any, *args: Any,
                 meshzero_config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> None:
        self.meshzero_raw_config = read_raw_config(meshzero_config)
        trainer_cls.__init__(self, *args, **kwargs)  # its super().__init__ reaches ours

    name = f"Meshzero{trainer_cls.__name__}"
    doc = (f"``{trainer_cls.__module__}.{trainer_cls.__qualname__}`` on meshzero "
           f"(``meshzero.hf.on_meshzero``); pass ``meshzero_config=``.")
    return type(name, (trainer_cls, MeshzeroTrainer),
                {"__init__": __init__, "__doc__": doc, "__module__": __name__,
                 "__qualname__": name})

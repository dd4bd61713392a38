"""TRL's frozen models (reference, reward, teacher) as ZeRO-3 engines without an optimizer.

A TRL trainer keeps its reference model in ``self.ref_model`` (DPO, KTO, GRPO: the model
given as ``ref_model`` or the implicit copy it makes) and GRPO's model reward functions in
``self.reward_funcs``; under DeepSpeed it passes each to ``prepare_deepspeed`` (TRL's
``trl/models/utils.py``), which shards it at ZeRO-3 with no optimizer. Here each becomes
``meshzero.initialize(model=m, config=<the run's config, stage 3, no optimizer or
scheduler>)``: forward only, gathered unit by unit, its bytes in its engine's
``memory_report``. The trainer's attribute then holds a :class:`FrozenModel`: calling it runs
the engine's forward under ``torch.no_grad``; any other attribute is the model's own (``config``,
``name_or_path``, ...).

With PEFT there is nothing to shard: TRL leaves ``ref_model`` None and runs the policy with its
adapter disabled (no copy).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

import meshzero

logger = logging.getLogger(__name__)

FROZEN_ATTRIBUTES = ("ref_model", "reward_model", "teacher_model")
FROZEN_LISTS = ("reward_funcs",)  # GRPO: functions and models mixed
# compile too: a frozen model mostly generates, whose growing lengths would recompile
DROPPED_KEYS = ("optimizer", "scheduler", "gradient_clipping", "compile")


class FrozenModel(nn.Module):
    """A frozen model behind its optimizer-less engine: ``model(...)`` is the engine's forward
    without gradients; other attributes fall through to the model."""

    def __init__(self, engine: meshzero.Engine):
        super().__init__()
        self.engine = engine
        engine.eval()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["engine"].module, name)  # type: ignore[union-attr]


def frozen_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The run's resolved ds_config for a frozen model: stage 3, no optimizer, scheduler,
    clipping or compile, no optimizer offload (its parameter offload kept)."""
    cfg = {k: copy.deepcopy(v) for k, v in raw.items() if k not in DROPPED_KEYS}
    zero = dict(cfg.get("zero_optimization", {}))
    zero.pop("offload_optimizer", None)
    zero["stage"] = 3
    cfg["zero_optimization"] = zero
    return cfg


def _frozen_engine(model: nn.Module, raw: dict[str, Any], what: str) -> meshzero.Engine:
    for p in model.parameters():
        p.requires_grad_(False)
    engine, *_ = meshzero.initialize(model=model, config=frozen_config(raw))
    logger.info("%s: a ZeRO-3 engine without an optimizer (forward only)", what)
    return engine


def shard_frozen_models(trainer: Any, raw: dict[str, Any]) -> dict[str, meshzero.Engine]:
    """Replace the trainer's frozen models (``FROZEN_ATTRIBUTES``, the ``nn.Module`` entries
    of ``FROZEN_LISTS``) by :class:`FrozenModel` s over ZeRO-3 engines; returns the engines by
    attribute (``reward_funcs[0]``, ...). Collective."""
    engines: dict[str, meshzero.Engine] = {}
    for attr in FROZEN_ATTRIBUTES:
        model = getattr(trainer, attr, None)
        if isinstance(model, nn.Module) and not isinstance(model, FrozenModel):
            engines[attr] = _frozen_engine(model, raw, attr)
            setattr(trainer, attr, FrozenModel(engines[attr]))
    for attr in FROZEN_LISTS:
        models = getattr(trainer, attr, None)
        if not isinstance(models, list):
            continue
        for i, model in enumerate(models):
            if isinstance(model, nn.Module) and not isinstance(model, FrozenModel):
                engine = engines[f"{attr}[{i}]"] = _frozen_engine(model, raw, f"{attr}[{i}]")
                models[i] = FrozenModel(engine)
    return engines

"""The optimizer `meshzero.deepspeed.initialize` returns: the engine's own
``torch.optim.Optimizer``, its class swapped in place for a subclass that adds DeepSpeed's
ZeRO-optimizer attributes (``overflow``, ``cur_scale``, ``loss_scale``, ``parameter_offload``),
so schedulers, ``param_groups`` and ``state_dict`` are untouched."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from meshzero.deepspeed.runtime.base_optimizer import ZeROOptimizer
from meshzero.deepspeed.runtime.bf16_optimizer import BF16_Optimizer

if TYPE_CHECKING:
    from meshzero.deepspeed.engine import DeepSpeedEngine


class _ZeroOptimizerView(ZeROOptimizer):
    """DeepSpeed's `DeepSpeedZeroOptimizer`: the engine's own optimizer with its attributes.

    Mixed into a subclass of the optimizer's class (made once per class), so the optimizer
    stays that ``torch.optim.Optimizer``: schedulers, ``param_groups`` and ``state_dict`` are
    untouched."""

    _meshzero_engine: Callable[[], DeepSpeedEngine | None]

    def _engine(self) -> DeepSpeedEngine | None:
        ref = self.__dict__.get("_meshzero_engine")
        return ref() if ref is not None else None

    @property
    def overflow(self) -> bool:
        """DeepSpeed's `DeepSpeedZeroOptimizer.overflow`: the last step was skipped (inf/nan).

        An fp16 overflow, or inf/nan gradients under ``faults.nonfinite_grads: skip``."""
        engine = self._engine()
        return bool(engine is not None and engine.step_overflowed)

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's `DeepSpeedZeroOptimizer.cur_scale`: the loss scale (1.0 without fp16)."""
        engine = self._engine()
        return float(engine.loss_scale) if engine is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's `DeepSpeedZeroOptimizer.loss_scale`: the loss scale (1.0 without fp16)."""
        return self.cur_scale

    @property
    def parameter_offload(self) -> _ParameterOffload:
        """DeepSpeed's `DeepSpeedZeroOptimizer_Stage3.parameter_offload`: its hook lists, empty.

        TRL removes and re-registers the ZeRO-3 hooks around generation inside
        ``GatheredParameters``; meshzero's hooks find the units gathered there and do
        nothing, so they stay and there is nothing to remove (stage 3 only, as DeepSpeed)."""
        engine = self._engine()
        if engine is None or engine.zero_stage != 3:
            raise AttributeError("parameter_offload exists at zero_optimization.stage 3 only")
        return _ParameterOffload(engine.module)

    def _partition_all_parameters(self) -> None:
        """DeepSpeed's `DeepSpeedZeroOptimizer_Stage3._partition_all_parameters`: release all.

        ``engine.empty_partition_cache()`` (Lightning calls it before loading a checkpoint)."""
        engine = self._engine()
        if engine is not None:
            engine.empty_partition_cache()


class _ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as TRL drives it: the module and its hook lists."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: torch.nn.Module, count: Any = None) -> None:
        """meshzero's stage-3 hooks were never removed: nothing to register again."""

    _register_hooks_recursively = _register_deepspeed_module


_VIEW_CLASSES: dict[tuple[type, bool], type] = {}


def as_zero_optimizer(optimizer: torch.optim.Optimizer, engine: DeepSpeedEngine) -> None:
    """Give ``optimizer`` (in place) DeepSpeed's ZeRO-optimizer attributes, read from
    ``engine``: its class becomes a subclass of its class with :class:`_ZeroOptimizerView`."""
    cls = type(optimizer)
    config = engine.config
    # where DeepSpeed wraps the optimizer in its BF16_Optimizer (_do_optimizer_sanity_check)
    bf16 = bool(config.bf16.enabled and engine.zero_stage == 1
                and config.zero_optimization.offload_optimizer.device in (None, "none"))
    if not isinstance(optimizer, _ZeroOptimizerView):
        view = _VIEW_CLASSES.get((cls, bf16))
        if view is None:
            bases = (_ZeroOptimizerView, BF16_Optimizer, cls) if bf16 else (_ZeroOptimizerView, cls)
            view = type(cls.__name__, bases,
                        {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
            _VIEW_CLASSES[cls, bf16] = view
        optimizer.__class__ = view
    optimizer.__dict__["_meshzero_engine"] = weakref.ref(engine)

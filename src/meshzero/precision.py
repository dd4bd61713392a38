"""Loss scaling for fp16 training and float16 autocast (bf16 and fp32 need none), as
DeepSpeed's dynamic scaler, and the ``torch_autocast`` region.

Dynamic scaling: the loss is multiplied by ``scale`` before backward; a step whose gradients
hold inf/nan on any rank is skipped on every rank. ``hysteresis`` is how many overflows the
scale tolerates: each overflow uses up one, and the overflow that finds only one left halves
the scale (not below ``min_scale``), and so does every overflow after it, until the
hysteresis is restored. It is restored, and the scale doubled, after ``window`` clean steps
in a row (with ``consecutive_hysteresis``, after every clean step; the scale still doubles
only at the window). So from 2**16 with hysteresis 2, eight overflows in a row give
65536, 32768, 16384, ..., 512, as DeepSpeed's loss_scaler does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0  # clean steps since the last overflow
    hysteresis_left: int = 2
    consecutive_hysteresis: bool = False

    @classmethod
    def from_config(cls, fp16: Any, autocast: Any = None) -> LossScaler:
        """From the config's ``fp16`` block (``loss_scale`` 0 means dynamic); else, for a
        float16 ``torch_autocast``, torch's ``GradScaler`` schedule, which DeepSpeed uses
        there (``torch.amp.GradScaler`` in runtime/zero/stage_1_and_2.py, stage3.py and, at
        stage 0, engine.py): 2**16, halved at every overflow (no hysteresis, no floor),
        doubled after 2000 clean steps in a row."""
        if not fp16.enabled and autocast is not None and autocast.scales_loss:
            return cls(scale=float(2 ** 16), dynamic=True, window=2000, hysteresis=1,
                       min_scale=0.0, hysteresis_left=1)
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale))
        return cls(
            scale=float(2 ** fp16.initial_scale_power),
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_scale=float(fp16.min_loss_scale),
            hysteresis_left=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Record the outcome of one boundary step."""
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def autocast(config: Any, device: torch.device) -> AbstractContextManager[Any]:
    """``torch_autocast`` (its config section): the forward under ``torch.autocast`` in
    its dtype. Alone, parameters, master and gradients stay fp32 (float16: the loss scaled
    as :meth:`LossScaler.from_config` says); with bf16.enabled they are what bf16 makes
    them (bf16 parameters and gradients, the master as the bf16 keys say) and autocast runs
    the ops it lists as fp32 (losses, norms) in fp32."""
    if not config.enabled:
        return nullcontext()
    return torch.autocast(device.type, dtype=config.torch_dtype)


def cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in (nested) args to the compute dtype, like FSDP's cast_forward_inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple | list):
        return type(obj)(cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_inputs(v, dtype) for k, v in obj.items()}
    return obj

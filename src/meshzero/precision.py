"""Loss scaling for fp16 training (bf16 and fp32 need none).

Dynamic scaling: the loss is multiplied by ``scale`` before backward; a step whose gradients
hold inf/nan on any rank is skipped on every rank and, after ``hysteresis`` such steps, the
scale is halved (not below ``min_scale``); after ``window`` clean steps in a row it doubles.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, fp16) -> LossScaler:
        """From the config's ``fp16`` block (``loss_scale`` 0 means dynamic)."""
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
        )

    def update(self, overflow: bool) -> None:
        """Record the outcome of one boundary step."""
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

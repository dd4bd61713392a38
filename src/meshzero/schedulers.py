"""DeepSpeed's warmup learning-rate schedules as torch LRSchedulers.

Step counting follows torch: `last_epoch` is the number of optimizer steps taken, so the lr set
when the scheduler is built is the lr of step 0, and each `scheduler.step()` after
`optimizer.step()` moves to the next step. Every param group gets the schedule; state_dict and
load_state_dict come from `LRScheduler`.
"""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from meshzero.config import SchedulerConfig

WARMUP_TYPES = ("log", "linear")


def warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at `step`: 0 at step 0, 1 from `warmup_num_steps` on.

    "log" gives log(step + 1) / log(warmup_num_steps) (it reaches 1 one step early, at
    warmup_num_steps - 1, as DeepSpeed's does); "linear" gives step / warmup_num_steps.
    """
    if step >= warmup_num_steps:
        return 1.0  # also covers warmup_num_steps == 0: no warmup at all
    if warmup_type == "linear":
        return step / warmup_num_steps
    if warmup_num_steps == 1:
        return 0.0  # log(1) == 0; the only warmup step is step 0
    return math.log(step + 1) / math.log(warmup_num_steps)


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if warmup_num_steps < 0:
        raise ValueError(f"warmup_num_steps must be >= 0, got {warmup_num_steps}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def _check_total(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps <= warmup_num_steps:
        raise ValueError(
            f"total_num_steps ({total_num_steps}) must be greater than "
            f"warmup_num_steps ({warmup_num_steps})"
        )


class WarmupLR(LRScheduler):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stays there."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def gamma(self, step: int) -> float:
        """Where the lr sits between warmup_min_lr (0) and warmup_max_lr (1) at `step`."""
        return warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self.gamma(
            self.last_epoch
        )
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches warmup_min_lr at total_num_steps.

    After warmup, lr = min + (max - min) * (total - step) / (total - warmup), never below min;
    with the default warmup_min_lr of 0 this is max * (total - step) / (total - warmup), as in
    DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_total(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch
        )

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super().gamma(step)
        remaining = (self.total_num_steps - step) / (self.total_num_steps - self.warmup_num_steps)
        return max(0.0, remaining)


class WarmupCosineLR(LRScheduler):
    """Warmup then cosine decay, as ratios of each param group's base lr (the optimizer's lr).

    During warmup ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma; afterwards it
    follows a half cosine from 1 down to cos_min_ratio over total - warmup steps and stays at
    cos_min_ratio from total_num_steps on.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        _check_total(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio(self, step: int) -> float:
        """Multiplier applied to the base lr at `step`."""
        if step < self.warmup_num_steps:
            gamma = warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        decay_steps = self.total_num_steps - self.warmup_num_steps
        progress = min(1.0, (step - self.warmup_num_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float]:
        ratio = self.ratio(self.last_epoch)
        return [float(base_lr) * ratio for base_lr in self.base_lrs]


SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(optimizer: Optimizer, config: SchedulerConfig) -> LRScheduler:
    """The scheduler named by `config.type`, with its params (defaults filled) on `optimizer`."""
    if config.type not in SCHEDULERS:
        raise ValueError(f"scheduler.type = {config.type!r}; valid: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[config.type](optimizer, **config.validated_params())

"""DeepSpeed's warmup learning-rate schedules as torch LRSchedulers.

The lr of each step is the one a DeepSpeed engine uses: DeepSpeed builds the scheduler at
iteration -1 (its value before the schedule starts: warmup_min_lr, or a ratio of 0 for
WarmupCosineLR) and steps it after each optimizer step, so optimizer step s runs at the
schedule's iteration s - 1 and steps 0 and 1 both run at the warmup's start (with 10 log-warmup
steps from 0 to 1e-3: 0, 0, 3.01e-4, 4.77e-4, ...). A warmup of w >= 1 steps lasts max(2, w)
iterations, as in DeepSpeed; w = 0 (which DeepSpeed refuses) means no warmup at all.

`last_epoch` is torch's count of optimizer steps taken (skipped fp16 steps do not count, as in
DeepSpeed). Every param group gets the schedule; state_dict and load_state_dict come from
`LRScheduler`.
"""

import inspect
import math

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from meshzero.config import SchedulerConfig
from meshzero.config.layer_drop import LayerDropConfig

WARMUP_TYPES = ("log", "linear")


def effective_warmup(warmup_num_steps: int) -> int:
    """DeepSpeed warms up over at least 2 iterations; 0 stays "no warmup"."""
    return 0 if warmup_num_steps == 0 else max(2, warmup_num_steps)


def warmup_gamma(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at schedule iteration `it` (>= 0): 0 at iteration 0, 1 from
    the end of the warmup on.

    With w = effective_warmup(warmup_num_steps): "log" gives log(it + 1) / log(w) (it reaches
    1 one iteration early, at w - 1, as DeepSpeed's does); "linear" gives it / w.
    """
    w = effective_warmup(warmup_num_steps)
    if it >= w:
        return 1.0  # also covers w == 0: no warmup at all
    if warmup_type == "linear":
        return it / w
    return math.log(it + 1) / math.log(w)


def schedule_iteration(optimizer_steps: int) -> int:
    """The DeepSpeed schedule iteration that optimizer step `optimizer_steps` runs at (-1 for
    step 0: the scheduler's value before its first step)."""
    return optimizer_steps - 1


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

    def gamma(self, it: int) -> float:
        """Where the lr sits between warmup_min_lr (0) and warmup_max_lr (1) at iteration
        `it`; before the first iteration (-1) it is where iteration 0 starts."""
        return warmup_gamma(max(it, 0), self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float | torch.Tensor]:
        gamma = self.gamma(schedule_iteration(self.last_epoch))
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches warmup_min_lr at total_num_steps.

    After warmup, lr = min + (max - min) * (total - it) / (total - w), never below min (w the
    effective warmup), as in DeepSpeed.
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

    def gamma(self, it: int) -> float:
        w = effective_warmup(self.warmup_num_steps)
        it = max(it, 0)
        if it < w:
            return super().gamma(it)
        return max(0.0, (self.total_num_steps - it) / max(1, self.total_num_steps - w))


class WarmupCosineLR(LRScheduler):
    """Warmup then cosine decay, as ratios of each param group's base lr (the optimizer's lr).

    During warmup ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma; afterwards it
    follows a half cosine from 1 down to cos_min_ratio over total - w iterations (iteration
    it >= w is (it - w + 1) / (total - w) of the way) and stays at cos_min_ratio. As in
    DeepSpeed, the ratio before the first iteration is 0, so step 0 runs at lr 0 whatever
    warmup_min_ratio is.
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

    def ratio(self, it: int) -> float:
        """Multiplier applied to the base lr at schedule iteration `it`."""
        w = effective_warmup(self.warmup_num_steps)
        if it < 0:
            return 0.0 if w else 1.0
        if it < w:
            gamma = warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (it - w + 1) / max(1, self.total_num_steps - w))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float | torch.Tensor]:
        ratio = self.ratio(schedule_iteration(self.last_epoch))
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


def is_scheduler_object(lr_scheduler: object) -> bool:
    """A scheduler instance (torch's, or any object with ``step()`` that is not a
    callable ``optimizer -> scheduler``), as DeepSpeed tells the two apart."""
    if isinstance(lr_scheduler, LRScheduler):
        return True
    return (lr_scheduler is not None and not callable(lr_scheduler)
            and callable(getattr(lr_scheduler, "step", None)))


def check_scheduler_object(lr_scheduler: object, client_optimizer: object) -> None:
    """``initialize(optimizer=opt, lr_scheduler=sched)`` with ``sched`` built on ``opt``:
    ``opt`` is bound to the engine's optimizer, so ``sched`` drives training and
    ``engine.step()`` steps it (DeepSpeed's ``_configure_lr_scheduler`` takes a client
    scheduler object as it is and ``_take_model_step`` steps it after each applied step).
    Anything else cannot reach training: refused."""
    if not isinstance(client_optimizer, Optimizer):
        raise ValueError(
            f"lr_scheduler is a {type(lr_scheduler).__name__} object but optimizer= is "
            f"{type(client_optimizer).__name__}: pass the optimizer instance the scheduler "
            "was built on as optimizer=, or lr_scheduler as a callable optimizer -> scheduler")
    built_on = getattr(lr_scheduler, "optimizer", client_optimizer)
    if built_on is not client_optimizer:
        raise ValueError(f"lr_scheduler ({type(lr_scheduler).__name__}) was built on another "
                         "optimizer than the one passed as optimizer=: build it on that one")


class LayerDropSchedule:
    """Progressive layer drop's keep probability (``progressive_layer_drop``): 1.0 until
    the first optimizer step, then ``(1 - theta) exp(-gamma t) + theta`` with t the steps
    taken before the current one, the value DeepSpeed's engine sets on each accumulation
    boundary before its optimizer step (``ProgressiveLayerDrop.update_state``)."""

    def __init__(self, theta: float, gamma: float):
        self.theta, self.gamma = theta, gamma
        self.current = 1.0

    @classmethod
    def from_config(cls, config: LayerDropConfig, model: object) -> "LayerDropSchedule | None":
        """None unless enabled; ``model`` (an nn.Module; a factory's model is not checked
        before it is built) must take the keywords."""
        if not config.enabled:
            return None
        if isinstance(model, torch.nn.Module):
            check_layer_drop_forward(model)
        return cls(config.theta, config.gamma)

    def update(self, steps_taken: int) -> None:
        self.current = (1.0 - self.theta) * math.exp(-self.gamma * steps_taken) + self.theta

    def forward_kwargs(self) -> dict[str, object]:
        """What a training forward receives: DeepSpeed's keyword names."""
        return {"progressive_layer_drop": True, "pld_theta": self.current}


def check_layer_drop_forward(module: torch.nn.Module) -> None:
    """The model's forward must take the keywords progressive layer drop passes (DeepSpeed
    passes them too, and a forward without them fails at its first call)."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in ("progressive_layer_drop", "pld_theta") if k not in params]
    if missing:
        raise ValueError(
            f"progressive_layer_drop.enabled: {type(module).__name__}.forward does not take "
            f"the keyword(s) {missing} that every training forward then receives; add "
            "'progressive_layer_drop=False, pld_theta=1.0' to its signature (and drop layers "
            "with probability 1 - pld_theta), or disable progressive_layer_drop")

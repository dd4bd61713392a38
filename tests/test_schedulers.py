"""meshzero.schedulers: lr at chosen steps against DeepSpeed's documented algorithm written out
independently: optimizer step s runs at schedule iteration s - 1 (iteration -1 is the value
before the schedule starts), a warmup of w >= 1 lasts max(2, w) iterations."""

import math

import pytest
import torch

from meshzero.config import load_config
from meshzero.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def make_optimizer(lrs: tuple[float, ...] = (0.1, 0.1)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_trace(scheduler: torch.optim.lr_scheduler.LRScheduler, num_steps: int) -> list[list[float]]:
    """Learning rates of every group at steps 0 .. num_steps - 1."""
    trace = [list(scheduler.get_last_lr())]
    for _ in range(num_steps - 1):
        scheduler.optimizer.step()
        scheduler.step()
        trace.append(list(scheduler.get_last_lr()))
    assert trace[-1] == [group["lr"] for group in scheduler.optimizer.param_groups]
    return trace


def expected_warmup(step: int, lo: float, hi: float, warmup: int, kind: str) -> float:
    it = max(step - 1, 0)
    if it >= warmup:
        return hi
    fraction = it / warmup if kind == "linear" else math.log(it + 1) / math.log(warmup)
    return lo + fraction * (hi - lo)


STEPS = [0, 1, 2, 5, 9, 10, 11, 30, 59, 60, 61, 80]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind: str) -> None:
    scheduler = WarmupLR(make_optimizer(), 0.01, 0.5, warmup_num_steps=10, warmup_type=kind)
    trace = lr_trace(scheduler, 81)
    for step in STEPS:
        assert trace[step] == pytest.approx([expected_warmup(step, 0.01, 0.5, 10, kind)] * 2)
    assert trace[0] == pytest.approx([0.01, 0.01])
    assert trace[80] == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize(("lo", "kind"), [(0.0, "log"), (0.05, "linear")])
def test_warmup_decay_lr(lo: float, kind: str) -> None:
    scheduler = WarmupDecayLR(
        make_optimizer(), total_num_steps=60, warmup_min_lr=lo, warmup_max_lr=0.5,
        warmup_num_steps=10, warmup_type=kind,
    )  # fmt: skip
    trace = lr_trace(scheduler, 81)
    for step in STEPS:
        if step - 1 < 10:
            expected = expected_warmup(step, lo, 0.5, 10, kind)
        else:
            remaining = max(0.0, (60 - (step - 1)) / 50)
            expected = lo + (0.5 - lo) * remaining
        assert trace[step] == pytest.approx([expected] * 2)
    assert trace[11][0] == pytest.approx(0.5)
    assert trace[36][0] == pytest.approx(lo + (0.5 - lo) * 0.5)
    assert trace[61][0] == pytest.approx(lo) and trace[80][0] == pytest.approx(lo)


def expected_cosine_ratio(step: int, warmup: int, total: int, wmin: float, cmin: float,
                          kind: str) -> float:  # fmt: skip
    it = step - 1
    if it < 0:
        return 0.0  # DeepSpeed's ratio before the first iteration
    if it < warmup:
        return expected_warmup(step, wmin, 1.0, warmup, kind)
    progress = min(it - warmup + 1, total - warmup) / (total - warmup)
    return cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_scales_each_group_base_lr(kind: str) -> None:
    base = (0.2, 0.05)
    scheduler = WarmupCosineLR(
        make_optimizer(base), total_num_steps=60, warmup_min_ratio=0.1, warmup_num_steps=10,
        cos_min_ratio=0.01, warmup_type=kind,
    )  # fmt: skip
    trace = lr_trace(scheduler, 81)
    for step in STEPS:
        ratio = expected_cosine_ratio(step, 10, 60, 0.1, 0.01, kind)
        assert trace[step] == pytest.approx([b * ratio for b in base])
    assert trace[0] == pytest.approx([0.0, 0.0])  # DeepSpeed: lr 0 at step 0
    assert trace[1] == pytest.approx([0.02, 0.005])
    assert trace[35] == pytest.approx([b * (0.01 + 0.99 * 0.5) for b in base])
    assert trace[80] == pytest.approx([b * 0.01 for b in base])


def test_zero_warmup_starts_at_the_peak() -> None:
    warmup = lr_trace(WarmupLR(make_optimizer(), 0.0, 0.3, warmup_num_steps=0), 3)
    assert warmup == [[0.3, 0.3]] * 3
    decay = lr_trace(WarmupDecayLR(make_optimizer(), 4, 0.0, 0.4, warmup_num_steps=0), 6)
    assert [lrs[0] for lrs in decay] == pytest.approx([0.4, 0.4, 0.3, 0.2, 0.1, 0.0])
    cosine = lr_trace(WarmupCosineLR(make_optimizer((0.2,)), 2, 0.0, 0, cos_min_ratio=0.0), 4)
    assert [lrs[0] for lrs in cosine] == pytest.approx([0.2, 0.1, 0.0, 0.0])


def test_single_warmup_step_lasts_two_iterations_as_in_deepspeed() -> None:
    trace = lr_trace(WarmupLR(make_optimizer(), 0.1, 0.3, warmup_num_steps=1), 4)
    assert [lrs[0] for lrs in trace] == pytest.approx([0.1, 0.1, 0.3, 0.3])
    linear = lr_trace(WarmupLR(make_optimizer(), 0.0, 0.4, 1, warmup_type="linear"), 4)
    assert [lrs[0] for lrs in linear] == pytest.approx([0.0, 0.0, 0.2, 0.4])


def test_deepspeed_engine_lrs_pinned() -> None:
    """The lrs a DeepSpeed engine runs steps 0-3 at (issue 14), and the cosine schedule's
    first steps, from DeepSpeed's algorithm: iteration -1 at construction, one step() per
    optimizer step."""
    warm = lr_trace(WarmupLR(make_optimizer((1e-3,)), 0.0, 1e-3, 10), 4)
    assert [lrs[0] for lrs in warm] == pytest.approx([0.0, 0.0, 3.0103e-4, 4.7712e-4], rel=1e-4)
    decay = lr_trace(WarmupDecayLR(make_optimizer((1e-3,)), 12, 0.0, 1e-3, 10), 14)
    assert [lrs[0] for lrs in decay][10:] == pytest.approx([1e-3, 1e-3, 5e-4, 0.0])
    cos = lr_trace(WarmupCosineLR(make_optimizer((1e-3,)), 12, 0.1, 10, 0.0), 14)
    assert [lrs[0] for lrs in cos][:2] == pytest.approx([0.0, 1e-4])
    assert [lrs[0] for lrs in cos][11:] == pytest.approx([5e-4, 0.0, 0.0])


@pytest.mark.parametrize(
    "build",
    [
        lambda opt: WarmupLR(opt, 0.0, 1.0, warmup_num_steps=20, warmup_type="linear"),
        lambda opt: WarmupDecayLR(opt, 30, 0.0, 1.0, warmup_num_steps=5),
        lambda opt: WarmupCosineLR(opt, 30, warmup_min_ratio=0.0, warmup_num_steps=5),
    ],
    ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"],
)
def test_state_dict_round_trip(build) -> None:  # noqa: ANN001
    original = build(make_optimizer())
    lr_trace(original, 8)  # now at step 7
    state = original.state_dict()
    restored = build(make_optimizer())
    restored.load_state_dict(state)
    assert restored.last_epoch == original.last_epoch == 7
    assert lr_trace(restored, 6)[1:] == lr_trace(original, 6)[1:]


def test_build_scheduler_from_config() -> None:
    config = load_config(
        {
            "scheduler": {
                "type": "warmupcosinelr",
                "params": {"total_num_steps": 40, "warmup_num_steps": 8, "warmup_type": "linear"},
            }
        }
    )
    assert config.scheduler is not None
    scheduler = build_scheduler(make_optimizer((0.1,)), config.scheduler)
    assert isinstance(scheduler, WarmupCosineLR)
    assert scheduler.cos_min_ratio == 0.0001 and scheduler.warmup_min_ratio == 0.0
    trace = lr_trace(scheduler, 10)
    assert trace[5][0] == pytest.approx(0.1 * 4 / 8)
    # iteration 8 is already the first of the decay: (8 - 8 + 1) / 32 of the way
    assert trace[9][0] == pytest.approx(0.1 * expected_cosine_ratio(9, 8, 40, 0.0, 0.0001,
                                                                    "linear"))


@pytest.mark.parametrize(
    ("kind", "params", "cls"),
    [
        ("WarmupLR", {}, WarmupLR),
        ("WarmupDecayLR", {"total_num_steps": 2000}, WarmupDecayLR),
    ],
)
def test_build_scheduler_defaults(kind: str, params: dict, cls: type) -> None:
    config = load_config({"scheduler": {"type": kind, "params": params}})
    assert config.scheduler is not None
    scheduler = build_scheduler(make_optimizer(), config.scheduler)
    assert type(scheduler) is cls
    assert (scheduler.warmup_min_lr, scheduler.warmup_max_lr) == (0.0, 0.001)
    assert (scheduler.warmup_num_steps, scheduler.warmup_type) == (1000, "log")
    assert scheduler.get_last_lr() == [0.0, 0.0]


def test_invalid_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_num_steps=10)
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupCosineLR(make_optimizer(), total_num_steps=10, warmup_num_steps=-1)

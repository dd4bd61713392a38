"""meshzero.precision.LossScaler against DeepSpeed's documented dynamic loss scaling, written
out as sequences: hysteresis is used up by overflows and restored only by a clean window (or
by every clean step with consecutive_hysteresis)."""

from __future__ import annotations

from types import SimpleNamespace

from meshzero.precision import LossScaler


def scaler(power: int = 16, window: int = 1000, hysteresis: int = 2,
           consecutive: bool = False) -> LossScaler:
    fp16 = SimpleNamespace(enabled=True, loss_scale=0.0, initial_scale_power=power,
                           loss_scale_window=window, hysteresis=hysteresis, min_loss_scale=1.0,
                           consecutive_hysteresis=consecutive)
    return LossScaler.from_config(fp16)


def trajectory(s: LossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        s.update(overflow)
        out.append(s.scale)
    return out


def test_eight_overflows_halve_after_the_first() -> None:
    assert trajectory(scaler(), [True] * 8) == [65536, 32768, 16384, 8192, 4096, 2048, 1024, 512]


def test_hysteresis_comes_back_only_after_a_clean_window() -> None:
    s = scaler(window=3)
    # overflow uses the spare; two clean steps are not a window, so the next overflow halves
    assert trajectory(s, [True, False, False, True]) == [65536, 65536, 65536, 32768]
    # a full clean window doubles and restores the spare: the next overflow only uses it
    assert trajectory(s, [False, False, False, True, True]) == [32768, 32768, 65536, 65536,
                                                                32768]


def test_consecutive_hysteresis_restores_after_any_clean_step() -> None:
    s = scaler(window=100, consecutive=True)
    assert trajectory(s, [True, False, True, False, True, True]) == [65536] * 5 + [32768]


def test_overflows_before_the_first_update_from_two_to_the_32() -> None:
    """bigscience's zero2 config (initial_scale_power 32, hysteresis 2) on gradients that
    overflow above a scale of 2**15: DeepSpeed skips 18 steps before its first update."""
    s = scaler(power=32)
    skipped = 0
    while s.scale > 2 ** 15:
        s.update(True)
        skipped += 1
    assert skipped == 18


def test_static_scale_never_moves() -> None:
    fp16 = SimpleNamespace(enabled=True, loss_scale=128.0)
    s = LossScaler.from_config(fp16)
    assert trajectory(s, [True, False, True]) == [128.0] * 3

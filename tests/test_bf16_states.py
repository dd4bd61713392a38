"""``bf16.bf16_optimizer_states`` (issue 25): Adam's m and v kept in bf16 (the arithmetic in
fp32, each result rounded once into the state). Equal to a one-process reference that rounds
its states the same way, at every stage and with CPU offload; memory_report() and the
estimator count 2 + 2 bytes per element instead of 4 + 4."""

from __future__ import annotations

import functools

import pytest
import torch

from meshzero.config import load_config
from meshzero.estimate import Estimator, load_model, settings_from_config
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, reference_train

STEPS = 4
LR, WD = 1e-2, 0.01


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW whose m and v are stored in bf16 after every update."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for p in (p for g in self.param_groups for p in g["params"]):
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p, dtype=torch.bfloat16),
                             v=torch.zeros_like(p, dtype=torch.bfloat16))
            state["t"] += 1
            t = state["t"]
            m = 0.9 * state["m"].float() + 0.1 * p.grad
            v = 0.999 * state["v"].float() + 0.001 * p.grad * p.grad
            state["m"], state["v"] = m.bfloat16(), v.bfloat16()
            p -= LR * ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + ADAM_EPS) + WD * p)


def _config(stage: int, offload: str = "none", **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": offload}}
    bf16 = {"enabled": False, "bf16_optimizer_states": True, **extra}
    return zero_config(stage, global_batch=8, zero_optimization=zero, bf16=bf16)


RUNS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "cpu")]


def _train_all(rank: int, world_size: int, runs: list) -> dict:
    out = {}
    for run in runs:
        result = train(rank, world_size, "tricky", _config(*run), STEPS)
        out[run] = (result.params, result.memory)
    return out


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[n] - w).abs().max()) for n, w in want.items())


# W = 2 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    2,
    pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_states_equal_reference(tmp_path, world_size):
    batches = make_batches("tricky", STEPS, 8)
    ref = reference_train(lambda: build_model("tricky", 0), batches,
                          optimizer=Bf16StateAdamW).params
    fp32 = reference_train(lambda: build_model("tricky", 0), batches, eps=ADAM_EPS).params
    off_by = _max_diff(ref, fp32)  # what rounding the states changes
    assert off_by > 1e-4
    results = run_distributed(_train_all, world_size, tmp_path, RUNS, timeout=300)
    estimator = Estimator(load_model(functools.partial(build_model, "tricky")))
    for rank, per_rank in enumerate(results):
        for run, (params, memory) in per_rank.items():
            # summation order may flip a bf16 rounding of m or v: far below what it changes
            assert _max_diff(params, ref) < off_by / 20, (run, _max_diff(params, ref), off_by)
            states = sum(memory["optimizer_states"].values())
            settings = settings_from_config(_config(*run), world_size, seq_len=6)
            want = estimator.states(settings, world_size).report(rank)
            assert want == {k: memory[k] for k in want}, (run, rank)
            # m and v at 2 bytes each (+ a 4-byte step per fragment)
            fp32_settings = settings_from_config(
                _config(*run, bf16_optimizer_states=False), world_size, seq_len=6)
            fp32_states = estimator.states(fp32_settings, world_size).report(rank)
            assert sum(fp32_states["optimizer_states"].values()) > states


def test_bf16_states_config():
    cfg = load_config({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                       "optimizer": {"type": "AdamW"}})
    assert cfg.bf16.bf16_optimizer_states
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states.*'SGD'"):
        load_config({"bf16": {"bf16_optimizer_states": True},
                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states.*amsgrad"):
        load_config({"bf16": {"bf16_optimizer_states": True},
                     "optimizer": {"type": "Adam", "params": {"amsgrad": True}}})

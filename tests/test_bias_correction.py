"""``optimizer.params.bias_correction: false`` (issue 25) for Adam and AdamW: the update
DeepSpeed's fused and CPU Adam compute, m / (sqrt(v) + eps) with m and v uncorrected, at
every stage and with CPU and NVMe offload, against a one-process reference written here."""

from __future__ import annotations

import pytest
import torch

from meshzero.config import load_config
from meshzero.optimizers import DeepSpeedAdam
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, reference_train

STEPS = 4
LR, WD = 1e-2, 0.01


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam without bias correction; decay decoupled (AdamW) or added to the gradient."""

    def __init__(self, params, decoupled: bool):
        super().__init__(params, {})
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self, closure=None):
        for p in (p for g in self.param_groups for p in g["params"]):
            state = self.state[p]
            if not state:
                state.update(m=torch.zeros_like(p), v=torch.zeros_like(p))
            g = p.grad if self.decoupled else p.grad + WD * p
            state["m"] = 0.9 * state["m"] + 0.1 * g
            state["v"] = 0.999 * state["v"] + 0.001 * g * g
            update = state["m"] / (state["v"].sqrt() + ADAM_EPS)
            if self.decoupled:
                update = update + WD * p
            p -= LR * update


def _reference(kind: str, decoupled: bool):
    return reference_train(lambda: build_model(kind, 0), make_batches(kind, STEPS, 8),
                           optimizer=lambda ps: UncorrectedAdam(ps, decoupled))


def _config(kind: str, stage: int, offload: str, path: str | None = None) -> dict:
    params = {"lr": LR, "weight_decay": WD, "eps": ADAM_EPS, "bias_correction": False}
    if kind == "Adam":  # DeepSpeed's Adam with adam_w_mode false: L2 in the gradient
        params["adam_w_mode"] = False
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0,
                  "offload_optimizer": {"device": offload}}
    if offload == "nvme":  # several tiles, fragments cut at their edges
        zero["offload_optimizer"]["nvme_path"] = path
        zero["sub_group_size"] = 300
    return zero_config(stage, global_batch=8, zero_optimization=zero,
                       optimizer={"type": kind, "params": params})


# (optimizer type, stage, optimizer offload)
RUNS = [("AdamW", 0, "none"), ("AdamW", 1, "none"), ("AdamW", 2, "none"),
        ("AdamW", 3, "none"), ("AdamW", 3, "cpu"), ("Adam", 2, "none"), ("Adam", 2, "cpu")]


def _train_all(rank: int, world_size: int, runs: list, path: str) -> dict:
    return {run: train(rank, world_size, "tricky", _config(*run, path), STEPS).params
            for run in runs}


# W = 2 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    2,
    pytest.param(4, marks=pytest.mark.slow)])
def test_uncorrected_adam_equals_reference(tmp_path, world_size):
    refs = {kind: _reference("tricky", decoupled=kind == "AdamW") for kind in ("AdamW", "Adam")}
    corrected = reference_train(lambda: build_model("tricky", 0),
                                make_batches("tricky", STEPS, 8), eps=ADAM_EPS)
    for name, want in refs["AdamW"].params.items():  # the switch must change the result
        if not torch.allclose(want, corrected.params[name], rtol=1e-3):
            break
    else:
        pytest.fail("bias_correction false trains the same as true: the test means nothing")
    runs = RUNS + ([("AdamW", 3, "nvme")] if world_size == 2 else [])
    results = run_distributed(_train_all, world_size, tmp_path, runs, str(tmp_path),
                              timeout=300)
    for per_rank in results:
        for run, params in per_rank.items():
            for name, want in refs[run[0]].params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, r=run: f"{r} {n}: {m}")


def test_bias_corrected_deepspeed_adam_is_torch_adam():
    """The same class with correction on matches torch's AdamW and Adam (L2) to rounding."""
    torch.manual_seed(0)
    p0, grads = torch.randn(40), [torch.randn(40) for _ in range(5)]
    for decoupled, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
        ours = DeepSpeedAdam([a], lr=0.1, weight_decay=0.1, adam_w_mode=decoupled)
        theirs = torch_cls([b], lr=0.1, weight_decay=0.1, foreach=False)
        for g in grads:
            a.grad, b.grad = g.clone(), g.clone()
            ours.step()
            theirs.step()
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def test_bias_correction_false_with_amsgrad_is_refused():
    with pytest.raises(ValueError, match=r"optimizer\.params\.bias_correction.*amsgrad"):
        load_config({"optimizer": {"type": "AdamW", "params": {"bias_correction": False,
                                                               "amsgrad": True}}})

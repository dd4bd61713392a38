"""LAMB (issue 25): DeepSpeed's "Lamb" type under ZeRO equals an unsharded reference LAMB.

The reference below is written here from the paper's and DeepSpeed's FusedLamb arithmetic,
over whole parameters on one process; the engine steps fragments of parameters spread over
ranks, so every trust ratio needs norms summed over the ranks (an all-reduce per step).
"""

from __future__ import annotations

import math

import pytest
import torch

from meshzero.config import load_config
from meshzero.optimizers import Lamb
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, reference_train

STEPS = 4
LAMB = {"lr": 2e-2, "weight_decay": 0.01, "eps": ADAM_EPS, "max_coeff": 0.5, "min_coeff": 0.01}


class ReferenceLamb(torch.optim.Optimizer):
    """Whole-parameter LAMB on one process: m, v; u = m / (sqrt(v) + eps) + wd * p;
    p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * clamp(|p| / |u|) * u; optional global clip."""

    def __init__(self, params, lr, weight_decay, eps, max_coeff, min_coeff, betas=(0.9, 0.999),
                 max_grad_norm=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, eps=eps, betas=betas,
                                      max_coeff=max_coeff, min_coeff=min_coeff,
                                      max_grad_norm=max_grad_norm))
        self.ratios: list[float] = []

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
        for group in self.param_groups:
            b1, b2 = group["betas"]
            limit = group["max_grad_norm"]
            clip = (total + 1e-6) / limit if limit > 0 else 1.0
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                g = p.grad / clip if clip > 1 else p.grad
                state["m"] = b1 * state["m"] + (1 - b1) * g
                state["v"] = b2 * state["v"] + (1 - b2) * g * g
                u = state["m"] / (state["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = float(p.norm()), float(u.norm())
                ratio = 1.0 if w_norm == 0 or u_norm == 0 else \
                    min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                self.ratios.append(ratio)
                t = state["t"]
                p -= group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t) * ratio * u


def _reference(kind: str, **extra):
    params = dict(LAMB, **extra)
    opts: list[ReferenceLamb] = []

    def make(ps):
        opts.append(ReferenceLamb(ps, **params))
        return opts[-1]

    ref = reference_train(lambda: build_model(kind, 0), make_batches(kind, STEPS, 8),
                          optimizer=make)
    return ref, opts[0].ratios


def _config(stage: int, offload: str = "none", **params) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": offload}}
    return zero_config(stage, global_batch=8, zero_optimization=zero,
                       optimizer={"type": "Lamb", "params": dict(LAMB, **params)})


# (stage, optimizer offload): every stage, and the host tier at stages 2 and 3
RUNS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu")]


def _train_all(rank: int, world_size: int, kind: str, runs: list, **params) -> dict:
    return {run: train(rank, world_size, kind, _config(*run, **params), STEPS).params
            for run in runs}


# W = 4 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    pytest.param(2, marks=pytest.mark.slow),
    4])
def test_lamb_equals_unsharded_reference(tmp_path, world_size):
    """Stages 0-3 and CPU offload, on the tricky model: tied, frozen and unused parameters,
    uneven sizes (fragments of one parameter on several ranks)."""
    ref, ratios = _reference("tricky")
    # the trust ratio is the point: it must vary, clamp at both ends, and be 1 for a zero
    # tensor (LayerNorm biases at the first step)
    assert {LAMB["max_coeff"], LAMB["min_coeff"], 1.0} <= set(ratios)
    assert any(LAMB["min_coeff"] < r < LAMB["max_coeff"] for r in ratios)
    results = run_distributed(_train_all, world_size, tmp_path, "tricky", RUNS, timeout=300)
    for per_rank in results:
        for run, params in per_rank.items():
            for name, want in ref.params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, r=run: f"{r} {n}: {m}")


def test_lamb_max_grad_norm_clips_the_global_norm(tmp_path):
    ref, _ = _reference("mlp", max_grad_norm=0.05)
    assert min(ref.grad_norms) > 0.05, "the clip must be active for the test to mean anything"
    results = run_distributed(_train_all, 2, tmp_path, "mlp", [(1, "none"), (3, "cpu")],
                              max_grad_norm=0.05)
    unclipped, _ = _reference("mlp")
    for per_rank in results:
        for params in per_rank.values():
            for name, want in ref.params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(params["head.weight"], unclipped.params["head.weight"])


def test_lamb_without_bias_correction_and_eps_inside_sqrt():
    """FusedLamb's switches on one tensor, against the formula written out."""
    torch.manual_seed(0)
    p0, grads = torch.randn(5, 3), [torch.randn(5, 3) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = Lamb([p], lr=0.1, eps=1e-3, bias_correction=False, eps_inside_sqrt=True,
               weight_decay=0.1, max_coeff=10.0, min_coeff=0.0)
    want, m, v = p0.clone(), torch.zeros(5, 3), torch.zeros(5, 3)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        u = m / (v + 1e-3).sqrt() + 0.1 * want
        want = want - 0.1 * min(float(want.norm() / u.norm()), 10.0) * u
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_lamb_config_params_and_refusals():
    opt = load_config({"train_batch_size": 8, "optimizer": {"type": "lamb", "params": {
        "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3,
        "min_coeff": 0.01, "max_grad_norm": 1.0}}}).optimizer
    assert opt.type == "Lamb" and opt.params["max_coeff"] == 0.3
    with pytest.raises(ValueError, match=r"optimizer\.params\.min_coeff.*max_coeff"):
        load_config({"optimizer": {"type": "Lamb", "params": {"max_coeff": 0.1,
                                                              "min_coeff": 0.2}}})
    with pytest.raises(ValueError, match=r"tensor_parallel\.size = 2.*Lamb|Lamb.*"
                                         r"tensor_parallel\.size = 2"):
        load_config({"optimizer": {"type": "Lamb"},
                     "tensor_parallel": {"size": 2, "plan": "gpt"}})
    with pytest.raises(ValueError, match=r"offload_optimizer\.device = 'nvme'"):
        load_config({"optimizer": {"type": "Lamb"}, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})


def _train_bf16(rank: int, world_size: int, runs: list) -> dict:
    out = {}
    for run in runs:
        r = train(rank, world_size, "mlp", dict(_config(*run), bf16={"enabled": True}), STEPS)
        out[run] = (r.params, r.comm.get("optimizer_norms", {}).get("count", 0))
    return out


def test_lamb_on_bf16_gradient_shards(tmp_path):
    """bf16 gradients (converted for one step over every fragment, on the device and the
    host tier): within bf16 tolerance of the reference, one norm all-reduce per step."""
    params: dict = {}

    def make(ps):
        return ReferenceLamb(ps, **LAMB, **params)

    ref = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", STEPS, 8),
                          optimizer=make, dtype=torch.bfloat16)
    results = run_distributed(_train_bf16, 2, tmp_path, [(0, "none"), (2, "none"), (3, "cpu")])
    for per_rank in results:
        for run, (got, norm_reduces) in per_rank.items():
            assert norm_reduces == (0 if run[0] == 0 else 1), run
            for name, want in ref.params.items():
                torch.testing.assert_close(got[name], want, rtol=2e-2, atol=2e-3)


def test_a_lamb_the_caller_built_is_rebuilt_over_fragments():
    """optimizer=Lamb(...) passed to initialize: rebuilt over ZeRO's fragments with its
    hyperparameters and bound to their whole-parameter norms."""
    import meshzero

    model = build_model("mlp", 0)
    lamb = Lamb(model.parameters(), lr=3e-3, max_coeff=0.7, eps_inside_sqrt=True)
    engine, opt, *_ = meshzero.initialize(model=model, optimizer=lamb, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}})
    try:
        assert isinstance(opt, Lamb) and opt is not lamb and opt.fragment_norms is not None
        assert opt.defaults["max_coeff"] == 0.7 and opt.defaults["eps_inside_sqrt"]
        x, y = make_batches("mlp", 1, 8)[0]
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        assert engine.step()
    finally:
        engine.close()

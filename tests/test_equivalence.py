"""DESIGN.md section 4.1: N optimizer steps on N ranks equal one process on the global batch.

The reference is an independent single-process run with plain torch (tests.models), never
the engine at world size 1.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, reference_train

STEPS = 5


@functools.cache
def _reference(kind: str, global_batch: int, grad_accum: int = 1, clip: float = 0.0,
               dtype: torch.dtype = torch.float32):
    return reference_train(lambda: build_model(kind, 0), make_batches(kind, STEPS, global_batch),
                           grad_accum=grad_accum, clip=clip, dtype=dtype, eps=ADAM_EPS)


def _assert_params_equal(got: dict, want: dict, rtol: float, atol: float) -> None:
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol, msg=lambda m, n=name:
                                   f"{n}: {m}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_equals_single_process(tmp_path, stage, world_size):
    cfg = zero_config(stage, global_batch=8)
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    ref = _reference("mlp", 8)
    for r in results:
        _assert_params_equal(r.params, ref.params, rtol=1e-5, atol=1e-6)
    # each rank's loss is its local mean; their mean is the global batch's loss
    mean_losses = [sum(r.losses[i] for r in results) / world_size for i in range(STEPS)]
    assert mean_losses == pytest.approx(ref.losses, rel=1e-5)
    # every rank ends with bit-identical full parameters
    for r in results[1:]:
        for name, t in r.params.items():
            assert torch.equal(t, results[0].params[name]), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_accumulation_and_clipping(tmp_path, stage):
    cfg = zero_config(stage, global_batch=16, grad_accum=2, gradient_clipping=0.05)
    results = run_distributed(train, 2, tmp_path, "mlp", cfg, STEPS)
    ref = _reference("mlp", 16, grad_accum=2, clip=0.05)
    assert min(ref.grad_norms) > 0.05, "the clip must be active for the test to mean anything"
    for r in results:
        _assert_params_equal(r.params, ref.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_frozen_unused_and_reused_modules(tmp_path, stage, world_size):
    """TrickyModel: tied embedding/head, a frozen layer, an unused layer, a block called
    twice, a buffer; uneven sizes that need padding."""
    cfg = zero_config(stage, global_batch=8)
    results = run_distributed(train, world_size, tmp_path, "tricky", cfg, STEPS)
    ref = _reference("tricky", 8)
    model = build_model("tricky")
    for r in results:
        _assert_params_equal(r.params, ref.params, rtol=1e-5, atol=1e-6)
        # the frozen layer is unchanged; tied names hold the same values
        torch.testing.assert_close(r.params["frozen.weight"], model.frozen.weight.detach())
        assert torch.equal(r.params["head.weight"], r.params["embed.weight"])
        assert torch.equal(r.params["scale"], model.scale)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_within_bf16_tolerance(tmp_path, stage, world_size):
    cfg = zero_config(stage, global_batch=8, bf16={"enabled": True})
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    ref = _reference("mlp", 8, dtype=torch.bfloat16)
    for r in results:
        # fp32 masters differ only by bf16 rounding of forward/backward: a few bf16 ulps
        _assert_params_equal(r.params, ref.params, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_overflow_skips_that_step_on_every_rank(tmp_path, stage):
    cfg = zero_config(stage, global_batch=8,
                      fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    steps, bad = 4, 2
    clean = run_distributed(train, 2, tmp_path, "mlp", cfg, bad)
    results = run_distributed(train, 2, tmp_path, "mlp", cfg, bad + 1, overflow_step=bad)
    for r, c in zip(results, clean, strict=True):
        assert r.skipped_steps == 1
        assert r.loss_scales == [256.0, 256.0, 128.0]
        for name, t in r.params.items():  # the overflow step changed nothing
            assert torch.equal(t, c.params[name]), name
    assert steps > bad


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("stage", "division"), [
    (0, {"prescale_gradients": True}), (2, {"prescale_gradients": True}),
    (3, {"gradient_predivide_factor": 2.0}), (1, {"gradient_predivide_factor": 4.0}),
])  # fmt: skip
def test_gradients_divided_before_the_sum_give_the_same_step(tmp_path, stage, division,
                                                              world_size):
    """DeepSpeed's prescale_gradients / gradient_predivide_factor move where the 1/dp
    division happens, not what the step does: the parameters equal the single-process run.
    SGD (not Adam, which would hide a wrong gradient scale); a clipping threshold the norm
    stays under (active clipping would hide it too), so the norm is computed but not used."""
    sgd = {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}}
    cfg = zero_config(stage, global_batch=8, grad_accum=2, gradient_clipping=100.0,
                      optimizer=sgd, **division)
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    ref = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", STEPS, 8),
                          optimizer="SGD", lr=0.5, momentum=0.9, weight_decay=0.01,
                          grad_accum=2, clip=100.0)
    for r in results:
        _assert_params_equal(r.params, ref.params, rtol=1e-5, atol=1e-6)

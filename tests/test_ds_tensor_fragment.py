"""``meshzero.deepspeed.utils``' safe_get/set_* against plain torch's param, grad and state.

DeepSpeed: deepspeed/utils/tensor_fragment.py (``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state``, ``safe_set_full_fp32_param``,
``safe_set_full_optimizer_state`` and the ``safe_*_local_*`` functions): the full ones sum
each rank's fp32 fragment over the data-parallel group (collective), the local ones give
this rank's fragment; gradients exist after backward and before the step.
"""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.deepspeed import utils as ds_utils
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

NAMES = ("blocks.0.fc1.weight", "head.bias")


def _fill(t: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, t.numel()).view(t.shape)


def _reference():
    model = build_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False)
    params = dict(model.named_parameters())
    out = {}
    for i, (x, y) in enumerate(make_batches("mlp", 2, 8)):
        mlp_loss(model(x), y).backward()
        if i == 0:
            out["grad"] = {n: params[n].grad.clone() for n in NAMES}
        opt.step()
        opt.zero_grad()
        if i == 0:
            out["param"] = {n: params[n].detach().clone() for n in NAMES}
            out["exp_avg"] = {n: opt.state[params[n]]["exp_avg"].clone() for n in NAMES}
            with torch.no_grad():
                for n in NAMES:
                    params[n].copy_(_fill(params[n]))
                    opt.state[params[n]]["exp_avg"].copy_(_fill(params[n]) * 1e-3)
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _run(rank, world_size, stage):
    engine, *_ = meshzero.initialize(model=build_model("mlp"),
                                     config=zero_config(stage, global_batch=8))
    params = dict(engine.module.named_parameters())
    got = {"grad": {}, "param": {}, "exp_avg": {}, "local": {}}
    for i, batch in enumerate(make_batches("mlp", 2, 8)):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        if i == 0:
            for n in NAMES:
                got["grad"][n] = ds_utils.safe_get_full_grad(params[n])
                got["local"][n + "|grad"] = ds_utils.safe_get_local_grad(params[n])
        engine.step()
        if i == 0:
            for n in NAMES:
                p = params[n]
                got["param"][n] = ds_utils.safe_get_full_fp32_param(p)
                got["exp_avg"][n] = ds_utils.safe_get_full_optimizer_state(p, "exp_avg")
                got["local"][n] = ds_utils.safe_get_local_fp32_param(p)
                got["local"][n + "|exp_avg"] = ds_utils.safe_get_local_optimizer_state(
                    p, "exp_avg")
            for n in NAMES:  # full writes on one parameter, local ones on the other
                p = params[n]
                if n == NAMES[0]:
                    ds_utils.safe_set_full_fp32_param(p, _fill(p))
                    ds_utils.safe_set_full_optimizer_state(p, _fill(p) * 1e-3, "exp_avg")
                else:
                    mine = ds_utils.safe_get_local_fp32_param(p).numel()
                    start = _local_start(engine, p)
                    value = _fill(p).reshape(-1)[start:start + mine]
                    ds_utils.safe_set_local_fp32_param(p, value)
                    ds_utils.safe_set_local_optimizer_state(p, value * 1e-3, "exp_avg")
                    got["set_local"] = (ds_utils.safe_get_full_fp32_param(p),
                                        ds_utils.safe_get_full_optimizer_state(p, "exp_avg"))
                    # a local write reaches the master only (DeepSpeed's too): the compute
                    # parameters follow at the next step, so the forward before it differs
                    ds_utils.safe_set_full_fp32_param(p, _fill(p))
    got["final"] = engine.full_state_dict()
    return got


def _local_start(engine, p) -> int:
    """Where this rank's fragment of ``p`` starts in it (from its flat slot)."""
    group, slot = engine.zero.slot_of(p)
    lo, _ = group.owned
    return max(0, lo - slot.offset)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_get_set_match_plain_torch(tmp_path, world_size, stage):
    ref = _reference()
    results = run_distributed(_run, world_size, tmp_path, stage)
    for got in results:
        for kind in ("grad", "param", "exp_avg"):
            for n in NAMES:
                torch.testing.assert_close(got[kind][n], ref[kind][n], rtol=1e-5, atol=1e-6)
        want = _fill(ref["final"][NAMES[1]])
        torch.testing.assert_close(got["set_local"][0], want)
        torch.testing.assert_close(got["set_local"][1], want * 1e-3)
        for name, want in ref["final"].items():
            torch.testing.assert_close(got["final"][name], want, rtol=1e-5, atol=1e-6)
    for n in NAMES:  # the local fragments, in rank order, are the flattened parameter
        for key, kind in (("", "param"), ("|grad", "grad"), ("|exp_avg", "exp_avg")):
            whole = torch.cat([got["local"][n + key] for got in results])
            torch.testing.assert_close(whole, ref[kind][n].reshape(-1), rtol=1e-5, atol=1e-6)


def test_engine_less_parameter():
    p = torch.nn.Parameter(torch.ones(3))
    assert ds_utils.safe_get_full_fp32_param(p) is None
    with pytest.raises(ValueError, match="not held by a meshzero engine"):
        ds_utils.safe_get_local_fp32_param(p)

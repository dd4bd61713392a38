"""Offload (issue 4): the host and NVMe tiers train exactly like the engine without offload,
and memory_report() puts every byte in the tier where it lives."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config

STEPS = 5
TILE = 300  # sub_group_size: several NVMe tiles, and fragments cut at their edges


def offload(opt: str, param: str = "none", path: str | None = None, **zero) -> dict:
    out: dict = {"offload_optimizer": {"device": opt}, **zero}
    if param != "none":
        out["offload_param"] = {"device": param}
    for key in ("offload_optimizer", "offload_param"):
        if key in out and out[key]["device"] == "nvme":
            out[key]["nvme_path"] = path
            out["sub_group_size"] = TILE
    return out


# (stage, optimizer tier, parameter tier)
VARIANTS = [(1, "nvme", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
            (3, "nvme", "none"), (3, "nvme", "nvme")]


def _runs(rank: int, world_size: int, kind: str, variants: list, path: str, steps: int,
          **extra) -> dict:
    """Each stage without offload, then every variant; full params and losses of each."""
    out = {}
    for stage in sorted({v[0] for v in variants}):
        r = train(rank, world_size, kind, zero_config(stage, global_batch=8, **extra), steps)
        out[(stage, "none", "none")] = (r.params, r.losses, r.grad_norms)
    for stage, opt, param in variants:
        cfg = zero_config(stage, global_batch=8, **copy.deepcopy(extra))
        cfg["zero_optimization"].update(offload(opt, param, path))
        r = train(rank, world_size, kind, cfg, steps)
        out[(stage, opt, param)] = (r.params, r.losses, r.grad_norms)
    return out


def _assert_same(results: list[dict], exact: bool = True, **tol) -> None:
    for per_rank in results:
        for (stage, opt, param), (params, losses, norms) in per_rank.items():
            base_params, base_losses, base_norms = per_rank[(stage, "none", "none")]
            # last_grad_norm: cpu steps units in backward and sums the fp32 norms they were
            # checked with; nvme takes no norm unless something clips (docs/profiling.md)
            if opt == "nvme" and norms[0] is None:
                assert set(norms) == {None}, (stage, opt, param, norms)
            else:
                assert norms == pytest.approx(base_norms, rel=1e-5 if exact else tol["rtol"]), \
                    (stage, opt, param)
            for name, t in params.items():
                if exact:
                    assert torch.equal(t, base_params[name]), (stage, opt, param, name)
                else:
                    torch.testing.assert_close(t, base_params[name], **tol)
            assert losses == pytest.approx(base_losses, rel=1e-6), (stage, opt, param)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_offload_fp32_bit_identical_to_no_offload(tmp_path, world_size):
    results = run_distributed(_runs, world_size, tmp_path, "mlp", VARIANTS, str(tmp_path),
                              STEPS)
    _assert_same(results)


def test_offload_with_frozen_tied_and_unused_params(tmp_path):
    variants = [(3, "cpu", "cpu"), (3, "nvme", "nvme"), (2, "nvme", "none")]
    results = run_distributed(_runs, 2, tmp_path, "tricky", variants, str(tmp_path), 3)
    _assert_same(results)


def test_offload_bf16(tmp_path):
    variants = [(3, "cpu", "cpu"), (3, "nvme", "nvme")]
    results = run_distributed(_runs, 2, tmp_path, "mlp", variants, str(tmp_path), 3,
                              bf16={"enabled": True})
    _assert_same(results, exact=False, rtol=1.6e-2, atol=1e-5)


def _accum_runs(rank: int, world_size: int, path: str) -> dict:
    out = {}
    for name, extra in [("clip", {"gradient_clipping": 0.05, "gradient_accumulation_steps": 2,
                                  "train_batch_size": 16}),
                        ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}})]:
        for opt, param in [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")]:
            cfg = zero_config(3, global_batch=8, **extra)
            if opt != "none":
                cfg["zero_optimization"].update(offload(opt, param, path))
            r = train(rank, world_size, "mlp", cfg, 4,
                      overflow_step=1 if name == "fp16" else None)
            out[(name, opt)] = (r.params, r.skipped_steps)
    return out


def test_offload_accumulation_clipping_and_fp16_skip(tmp_path):
    """The paths that need the global gradient first (clipping, fp16 overflow) step after
    backward instead of unit by unit; accumulation adds micro-steps in the tier."""
    for per_rank in run_distributed(_accum_runs, 2, tmp_path, str(tmp_path)):
        for (name, opt), (params, skipped) in per_rank.items():
            base, base_skipped = per_rank[(name, "none")]
            assert skipped == base_skipped == (1 if name == "fp16" else 0)
            for key, t in params.items():
                assert torch.equal(t, base[key]), (name, opt, key)


# -- tiers ------------------------------------------------------------------------------------
def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def _report(model: nn.Module, tmp_path, **zero) -> dict:
    cfg = zero_config(3, global_batch=2, **{"zero_optimization": zero})
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    width = model[0].in_features
    for _ in range(2):
        loss = engine(torch.randn(2, width)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    report = engine.memory_report()
    engine.close()
    return report


def _tier_total(report: dict, tier: str) -> int:
    return sum(v[tier] for v in report.values() if isinstance(v, dict))


def test_nvme_tier_keeps_device_and_host_bounded_by_buffers(tmp_path):
    zero = offload("nvme", "nvme", str(tmp_path), sub_group_size=4096)
    small, big = (_report(_mlp(w), tmp_path, **zero) for w in (64, 128))
    for tier in ("device", "host"):
        assert _tier_total(small, tier) == _tier_total(big, tier), tier
    assert _tier_total(small, "device") == 0  # no persistent params: everything is a file
    assert small["offload_buffers"]["host"] > 0
    assert _tier_total(big, "nvme") > 3.9 * _tier_total(small, "nvme")  # 4x the params
    psi = sum(p.numel() for p in _mlp(128).parameters())
    assert big["master_params"]["nvme"] == big["grads"]["nvme"] == 4 * psi
    assert big["params"]["nvme"] == 4 * psi


def test_host_tier_report_and_files_removed(tmp_path):
    psi = sum(p.numel() for p in _mlp(64).parameters())
    rep = _report(_mlp(64), tmp_path, **offload("cpu", "cpu"))
    assert rep["params"] == {"device": 0, "host": 4 * psi, "nvme": 0}
    assert rep["master_params"] == {"device": 0, "host": 4 * psi, "nvme": 0}
    assert rep["grads"] == {"device": 0, "host": 4 * psi, "nvme": 0}
    assert rep["optimizer_states"]["host"] == 8 * psi + 4 * 8  # m, v and 8 step counters
    _report(_mlp(64), tmp_path, **offload("nvme", "nvme", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # engine.close() removed the rank's directory


@pytest.mark.parametrize(("opt", "tier"), [("none", "device"), ("cpu", "host"),
                                           ("nvme", "nvme")])
def test_one_tier_chosen_from_the_config(tmp_path, opt, tier):
    cfg = zero_config(3, global_batch=2, **{"zero_optimization": offload(opt, "none",
                                                                          str(tmp_path))})
    engine, optimizer, *_ = meshzero.initialize(model=_mlp(16), config=cfg)
    chosen = engine.zero.tier
    assert chosen.name == tier
    assert all(g.tier is chosen for g in engine.zero.groups)  # one object decides for all
    leaves = [p for group in optimizer.param_groups for p in group["params"]]
    assert leaves and all(p.device == chosen.optimizer_device for p in leaves)
    masters = [g.master_is_copy for g in engine.zero.groups if g.trainable]
    assert masters == [tier != "device"] * len(masters)  # fp32: no copy on the device
    engine.close()

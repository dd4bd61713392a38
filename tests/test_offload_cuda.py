"""Offload on CUDA (issue 23): every host buffer that crosses PCIe is page-locked, every
offload copy has a pinned host side, and the asynchronous copies still train exactly like
the device tier. Skipped without CUDA (run on the GPU machine:
``python -m pytest -q tests/test_offload_cuda.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshzero

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def single_rank():
    """World size 1 on NCCL in this process (initialize makes the group)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])


def _config(stage: int, opt: str, param: str, path: str, **extra) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0,
                  "sub_group_size": 2048}
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt, "nvme_path": path}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": path}
    return {"train_batch_size": 4, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4}},
            "zero_optimization": zero, **extra}


def _train(config: dict, steps: int = 3):
    engine, *_ = meshzero.initialize(model=_model(), config=copy.deepcopy(config))
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 64, device="cuda")
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return engine


@pytest.mark.parametrize("stage,opt,param", [(2, "cpu", "none"), (3, "cpu", "cpu"),
                                             (3, "nvme", "nvme")])
def test_host_buffers_are_pinned(single_rank, tmp_path, stage, opt, param):
    """Gradient shards, masters and host parameter shards are page-locked, and every
    offload copy of a step had a page-locked host side."""
    engine = _train(_config(stage, opt, param, str(tmp_path)))
    tier = engine.zero.tier
    assert tier.options.pin_memory  # the default on CUDA
    for g in engine.zero.groups:
        if opt == "cpu" and g.trainable:
            assert g.master.is_pinned() and g.grad.is_pinned()
        if g.sharded and param == "cpu":
            assert g.shard.is_pinned()
    report = engine.transfer_report()
    for direction in ("d2h", "h2d"):
        assert report[direction]["count"] > 0
        assert report[direction]["pinned_count"] == report[direction]["count"], direction
    engine.close()


def test_pin_memory_false_is_honoured(single_rank, tmp_path):
    cfg = _config(2, "cpu", "none", str(tmp_path))
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    engine = _train(cfg, steps=1)
    assert not engine.zero.tier.options.pin_memory
    assert not any(g.master.is_pinned() for g in engine.zero.groups if g.trainable)
    engine.close()


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_async_copies_train_like_the_device_tier(single_rank, tmp_path, clip):
    """The copy stream and the worker's unit steps train like no offload. The host's and
    the GPU's AdamW round differently, and a flipped bf16 parameter changes later gradients,
    so a few elements may differ by up to lr; an ordering bug (a unit stepped on gradients
    not yet landed, parameters read before they crossed) moves most of them by ~lr."""
    states = {}
    for opt in ("none", "cpu"):
        engine = _train(_config(2, opt, "none", str(tmp_path), gradient_clipping=clip))
        states[opt] = engine.full_state_dict()
        engine.close()
    for key, t in states["none"].items():
        far = ((states["cpu"][key] - t).abs() > 1e-4).float().mean().item()
        assert far < 0.01, (key, far)

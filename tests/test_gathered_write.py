"""``engine.gathered(params, modifier_rank=r)``: what rank r writes reaches every rank.

DeepSpeed: ``GatheredParameters.__exit__`` (deepspeed/runtime/zero/partition_parameters.py)
broadcasts the modifier rank's full parameters and partitions them again. meshzero writes
the broadcast values into the fp32 master too, at every stage, so training continues from
them: the tests hold it to plain torch that made the same write.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _write(model: nn.Module) -> list[nn.Parameter]:
    """Weight surgery and a custom init: the parameters it writes."""
    first = model.blocks[0].fc1
    with torch.no_grad():
        first.weight[:3].copy_(first.weight[3:6] * 0.5)  # rows copied
        nn.init.constant_(first.bias, 0.25)
    return [first.weight, first.bias]


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain torch: the values right after the write, and after the steps that follow."""
    model = build_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False)
    written = {}
    for i, (x, y) in enumerate(make_batches("mlp", STEPS_BEFORE + STEPS_AFTER, 8)):
        if i == STEPS_BEFORE:
            _write(model)
            written = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mlp_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return written, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world_size, stage, modifier_rank, mics=None):
    cfg = zero_config(stage, global_batch=8)
    if mics is not None:
        cfg["zero_optimization"]["mics_shard_size"] = mics
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    model = engine.module
    batches = make_batches("mlp", STEPS_BEFORE + STEPS_AFTER, 8)
    written = {}
    for i, batch in enumerate(batches):
        if i == STEPS_BEFORE:
            first = model.blocks[0].fc1
            with torch.no_grad(), engine.gathered([first.weight, first.bias],
                                                  modifier_rank=modifier_rank):
                if rank == modifier_rank:
                    _write(model)
                else:  # another rank's writes are dropped
                    first.weight.data.fill_(7.0)
            written = engine.full_state_dict()
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    return written, engine.full_state_dict()


@pytest.mark.parametrize("world_size,stage", [(1, 1), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3),
                                              (4, 1), (4, 3)])
def test_modifier_rank_write_trains_as_plain_torch(tmp_path, world_size, stage):
    modifier = world_size - 1
    results = run_distributed(_train, world_size, tmp_path, stage, modifier)
    ref_written, ref = _reference()
    for written, final in results:
        for name, want in ref_written.items():  # full_state_dict: every rank, every name
            torch.testing.assert_close(written[name], want, rtol=1e-5, atol=1e-6)
        for name, want in ref.items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6)


def test_mics_write_reaches_every_replica(tmp_path):
    """MiCS (shards over blocks of 2 of 4 ranks): data-parallel rank 3 is rank 1 of the
    second block; its write reaches both blocks."""
    ref_written, ref = _reference()
    for written, final in run_distributed(_train, 4, tmp_path, 3, 3, mics=2):
        for name, want in ref_written.items():
            torch.testing.assert_close(written[name], want, rtol=1e-5, atol=1e-6)
        for name, want in ref.items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6)


def _resize_inside(rank, world_size):
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=zero_config(3,
                                                                                  global_batch=8))
    fc1 = engine.module.blocks[0].fc1
    try:
        with torch.no_grad(), engine.gathered([fc1.bias], modifier_rank=0):
            if rank == 0:
                fc1.bias.data = torch.zeros(fc1.bias.numel() + 1)
    except ValueError as e:
        return str(e)
    return "no error"


def test_shape_change_raises_on_every_rank(tmp_path):
    for message in run_distributed(_resize_inside, 2, tmp_path):
        assert "blocks.0.fc1.bias" in message and "not shapes" in message, message


def _bf16_write(rank, world_size, stage, offload):
    cfg = zero_config(stage, global_batch=8, bf16={"enabled": True})
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    fc1 = engine.module.blocks[0].fc1
    x, y = split_for_rank(make_batches("mlp", 1, 8)[0], rank, world_size, 1, 0)
    engine.backward(mlp_loss(engine(x), y))
    engine.step()
    with torch.no_grad(), engine.gathered([fc1.weight, fc1.bias], modifier_rank=0):
        if rank == 0:
            fc1.weight.fill_(0.125)  # exact in bf16: the fp32 master must hold it exactly
            fc1.bias.data = torch.full(fc1.bias.shape, 0.25)  # p.data replaced, in fp32
    with torch.no_grad(), engine.gathered([fc1.weight, fc1.bias]):
        compute = (fc1.weight.detach().float().clone(), fc1.bias.detach().float().clone(),
                   fc1.weight.dtype)
    return engine.full_state_dict(), compute


@pytest.mark.parametrize("stage,offload", [(1, False), (3, False), (3, True)])
def test_mixed_precision_write_reaches_the_fp32_master(tmp_path, stage, offload):
    """bf16 compute with an fp32 master (a copy; in host memory with offload_optimizer):
    both get the modifier's values."""
    for state, (weight, bias, dtype) in run_distributed(_bf16_write, 2, tmp_path, stage,
                                                        offload):
        assert dtype == torch.bfloat16
        assert (state["blocks.0.fc1.weight"] == 0.125).all()
        assert (state["blocks.0.fc1.bias"] == 0.25).all()
        assert (weight == 0.125).all() and (bias == 0.25).all()

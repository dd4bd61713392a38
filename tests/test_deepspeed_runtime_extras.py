"""The small ``deepspeed.runtime`` / ``deepspeed.pipe`` names real code imports, each against
DeepSpeed 0.19.6's source."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import meshzero.deepspeed as deepspeed
from meshzero import schedulers
from meshzero.deepspeed.runtime import lr_schedules
from meshzero.deepspeed.runtime.utils import see_memory_usage, set_random_seed
from meshzero.deepspeed.runtime.zero.offload_config import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)


def test_set_random_seed_seeds_random_numpy_and_torch() -> None:
    """DeepSpeed's runtime/utils.py ``set_random_seed``: random, numpy (a seed over 2**32
    taken modulo, as numpy takes 32 bits) and torch."""
    draws = []
    for _ in range(2):
        set_random_seed(2**40 + 7)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert draws[0] == draws[1]


def test_see_memory_usage_prints_only_when_forced(capsys: pytest.CaptureFixture) -> None:
    """DeepSpeed's runtime/utils.py ``see_memory_usage``: prints the message and the memory
    figures with ``force``, nothing without."""
    see_memory_usage("quiet")
    see_memory_usage("after init", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after init" and lines[1].startswith("MA ") and len(lines) == 2


def test_pipe_topology_is_deepspeeds_row_major_grid() -> None:
    """DeepSpeed's runtime/pipe/topology.py ``PipeModelDataParallelTopology(num_pp, num_mp,
    num_dp)``: axes (pipe, data, model), the last varying fastest."""
    from meshzero.deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.world_size() == 8 and topo.get_dim("data") == 2 and topo.get_dim("x") == 0
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert tuple(topo.get_coord(5)) == (1, 0, 1)
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 4]
    assert topo.filter_match(pipe=0, model=1) == [1, 3]
    assert topo.get_rank_repr(5) == "model_01"


def test_offload_enums_have_deepspeeds_values() -> None:
    """DeepSpeed's runtime/zero/offload_config.py ``OffloadDeviceEnum`` and
    ``OffloadStateTypeEnum`` (str enums: they compare equal to the config's strings)."""
    assert OffloadDeviceEnum.cpu == "cpu" and [e.value for e in OffloadDeviceEnum] == [
        "none", "cpu", "nvme"]
    assert [e.value for e in OffloadStateTypeEnum] == [
        "optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


def test_warmup_schedules_take_deepspeeds_keyword() -> None:
    """DeepSpeed's runtime/lr_schedules.py ``WarmupLR(..., last_batch_iteration=-1)``: the
    same lr per step as meshzero's WarmupLR (which holds DeepSpeed's values); the two
    schedules meshzero lacks raise naming torch's."""
    def lrs(cls, **kw) -> list[float]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = cls(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=5, **kw)
        out = []
        for _ in range(7):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert lrs(lr_schedules.WarmupLR, last_batch_iteration=-1) == lrs(schedulers.WarmupLR)
    assert "OneCycle" in lr_schedules.VALID_LR_SCHEDULES
    with pytest.raises(NotImplementedError, match="OneCycleLR"):
        lr_schedules.OneCycle(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0))


def test_pipeline_module_is_the_sequential_meshzero_splits() -> None:
    """DeepSpeed's pipe/module.py ``PipelineModule(layers, num_stages, loss_fn)`` with
    ``LayerSpec``s and plain callables; ``TiedLayerSpec`` and activation_checkpoint_interval
    are refused naming the meshzero way."""
    torch.manual_seed(0)
    model = deepspeed.pipe.PipelineModule(
        layers=[deepspeed.pipe.LayerSpec(nn.Linear, 4, 8), torch.relu, nn.Linear(8, 2)],
        num_stages=2, loss_fn=nn.functional.mse_loss)
    assert isinstance(model, nn.Sequential) and model.num_stages == 2
    x = torch.randn(3, 4)
    assert torch.equal(model(x), model[2](torch.relu(model[0](x))))
    with pytest.raises(NotImplementedError, match="does not tie layers across stages"):
        deepspeed.pipe.TiedLayerSpec("embed", nn.Linear, 4, 4)
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        deepspeed.pipe.PipelineModule([nn.Linear(2, 2)], num_stages=1,
                                      activation_checkpoint_interval=1)


def test_names_megatron_and_accelerate_read() -> None:
    """DeepSpeed's accelerator/cuda_accelerator.py typed-tensor properties (``LongTensor``:
    ``functools.partial(torch.tensor, dtype=torch.long, device=...)``), checkpointing.py's
    ``_MODEL_PARALLEL_RNG_TRACKER_NAME``, runtime/config.py's optimizer names and
    utils/groups.py ``_get_sequence_parallel_rank`` / ``_get_sequence_parallel_group``
    (KeyError without an sp group)."""
    from meshzero.deepspeed.checkpointing import _MODEL_PARALLEL_RNG_TRACKER_NAME
    from meshzero.deepspeed.runtime.config import ADAM_OPTIMIZER, LAMB_OPTIMIZER
    from meshzero.deepspeed.utils import groups

    acc = deepspeed.get_accelerator()
    t = acc.LongTensor([1, 2])
    assert t.dtype == torch.long and t.device.type == acc.device_name()
    assert acc.ByteTensor([1]).dtype == torch.uint8 and acc.HalfTensor([1]).dtype == torch.half
    assert _MODEL_PARALLEL_RNG_TRACKER_NAME == "model-parallel-rng"
    assert (ADAM_OPTIMIZER, LAMB_OPTIMIZER) == ("adam", "lamb")
    assert groups._get_sequence_parallel_rank() == 0
    with pytest.raises(KeyError, match="sp_group"):
        groups._get_sequence_parallel_group()


def test_initialize_refuses_a_multi_stage_pipeline_module_naming_the_meshzero_way() -> None:
    """DeepSpeed's ``initialize`` builds a PipelineEngine for a PipelineModule
    (deepspeed/__init__.py); meshzero's pipeline needs example inputs DeepSpeed's signature
    cannot carry, so a module of more than one stage is refused before any work."""
    model = deepspeed.pipe.PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2,
                                          loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"meshzero.initialize\(model=module.*example_inputs"):
        deepspeed.initialize(model=model, config={"train_batch_size": 2})


def test_tp_model_init_records_the_size_initialize_uses() -> None:
    """DeepSpeed's deepspeed/__init__.py ``tp_model_init`` records the tp arguments that
    ``initialize`` merges with the config (the config canonical, a mismatch an error); the
    model comes back unsliced, in ``dtype``."""
    from meshzero.deepspeed.tp import with_recorded_tp

    model = deepspeed.tp_model_init(nn.Linear(4, 4), tp_size=2, dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16 and model.weight.shape == (4, 4)
    assert with_recorded_tp({"train_batch_size": 2}, model)["tensor_parallel"] == {"size": 2}
    with pytest.raises(ValueError, match="tp_size=2.*size is 4"):
        with_recorded_tp({"tensor_parallel": {"size": 4}}, model)
    with pytest.raises(ValueError, match="tensor_parallel size is 4"):
        deepspeed.initialize(model=model, config={"train_batch_size": 2,
                                                  "tensor_parallel": {"size": 4}})
    one = deepspeed.tp_model_init(nn.Linear(2, 2), tp_size=1, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=one, config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.topology.tp_size == 1
    engine.close()

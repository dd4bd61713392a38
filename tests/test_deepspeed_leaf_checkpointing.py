"""``meshzero.deepspeed.checkpointing``: DeepSpeed's activation checkpointing API
(deepspeed/runtime/activation_checkpointing/checkpointing.py) over torch.utils.checkpoint:
the gradients of a plain forward, DeepSpeed's configure arguments (honoured or named in one
INFO line each), and Megatron's RNG tracker (CudaRNGStatesTracker, model_parallel_cuda_
manual_seed) over torch's RNG."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import meshzero.deepspeed as deepspeed
from meshzero.deepspeed import checkpointing


@pytest.fixture(autouse=True)
def _fresh_settings():
    yield
    checkpointing.configure(None)  # back to DeepSpeed's defaults for the next test
    checkpointing.get_cuda_rng_tracker().reset()
    checkpointing._SETTINGS.mpu = None


def _grads(run) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 5))
    x = torch.randn(3, 5, requires_grad=True)
    run(block, x).pow(2).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("settings", [{}, {"checkpoint_in_cpu": True, "synchronize": True,
                                           "profile": True}])
@pytest.mark.parametrize("how", ["checkpoint", "non_reentrant", "function"])
def test_gradients_equal_no_checkpoint(settings, how):
    """checkpoint(function, *args) (DeepSpeed's checkpoint / CheckpointFunction.apply /
    non_reentrant_checkpoint) gives the gradients the plain forward gives, also with
    checkpoint_in_cpu, synchronize and profile configured."""
    checkpointing.configure(None, **settings)

    def run(block, x):
        if how == "checkpoint":
            return deepspeed.checkpointing.checkpoint(block, x)
        if how == "non_reentrant":
            return checkpointing.non_reentrant_checkpoint(block, x)
        outputs: list = []
        checkpointing.CheckpointFunction.apply(block, outputs, x)
        return outputs[0]

    for got, want in zip(_grads(run), _grads(lambda block, x: block(x)), strict=True):
        torch.testing.assert_close(got, want)


def test_configure_names_what_it_does_not_implement(caplog, tmp_path):
    """configure accepts DeepSpeed's arguments and its config section (configure,
    _configure_using_config_file); partition_activations and contiguous checkpointing are not
    implemented and each says so in one INFO line; is_configured turns True; an unknown
    section key raises naming the valid ones."""
    assert checkpointing.is_configured() in (False, True)
    config = {"activation_checkpointing": {"partition_activations": True,
                                           "contiguous_memory_optimization": True,
                                           "number_checkpoints": 4, "cpu_checkpointing": True}}
    with caplog.at_level("INFO", logger="meshzero.deepspeed"):
        checkpointing.configure(None, deepspeed_config=config, synchronize=False)
    lines = [r.message for r in caplog.records if "not implemented" in r.message]
    assert len(lines) == 3 and "partition_activations" in lines[0]
    assert checkpointing.is_configured()
    checkpointing.reset()
    path = tmp_path / "ds.json"  # Megatron-DeepSpeed's call: a JSON path and its arguments
    path.write_text(json.dumps(config))
    checkpointing.configure(_Mpu(), deepspeed_config=str(path), num_checkpoints=24,
                            checkpoint_in_cpu=False)
    checkpointing.set_num_layers(24)
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"x": 1}})


class _Mpu:
    def get_tensor_model_parallel_rank(self) -> int:
        return 1


def test_megatron_rng_tracker():
    """Megatron-DeepSpeed's calls: configure(mpu), model_parallel_cuda_manual_seed(seed) seeds
    torch's RNG with seed and the tracker's "model-parallel-rng" state with seed + 2718 + tp
    rank (DeepSpeed's offsets); fork() runs on that state and restores the default one;
    get_states/set_states round-trip; add() refuses a seed or name twice."""
    checkpointing.configure(_Mpu())
    checkpointing.model_parallel_cuda_manual_seed(1234)
    tracker = checkpointing.get_cuda_rng_tracker()
    default_first = torch.rand(3)
    states = tracker.get_states()
    with tracker.fork():
        forked = torch.rand(3)
    torch.manual_seed(1234 + 2718 + 1)
    assert torch.equal(forked, torch.rand(3))
    torch.manual_seed(1234)
    assert torch.equal(default_first, torch.rand(3))
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(forked, torch.rand(3))  # the saved state replays
    checkpointing.model_parallel_reconfigure_tp_seed(7)  # the tracker's state only
    with tracker.fork():
        reseeded = torch.rand(3)
    torch.manual_seed(7 + 2718 + 1)
    assert torch.equal(reseeded, torch.rand(3))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(ValueError, match="not added"), tracker.fork("other"):
        pass


def test_runtime_module_path_is_the_same_module():
    """Megatron-DeepSpeed imports deepspeed.runtime.activation_checkpointing.checkpointing:
    the same functions and settings as deepspeed.checkpointing."""
    from meshzero.deepspeed.runtime.activation_checkpointing import checkpointing as path

    path.configure(None, synchronize=True)
    assert checkpointing.is_configured() and path.checkpoint is checkpointing.checkpoint
    assert path.get_cuda_rng_tracker() is checkpointing.get_cuda_rng_tracker()

"""One source of truth: `meshzero estimate --config X` refuses exactly what `initialize`
refuses, with the same message, because the estimator's settings are a view of the same
validated config (and its flags are overrides validated again)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import meshzero
from meshzero.cli import main
from tests.distributed import run_distributed
from tests.models import build_model

# (bad config, a piece of the message both must give); run on a world of one
BAD_CONFIGS = [
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer.device = 'cpu' needs zero_optimization.stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offload_param.device = 'cpu' needs zero_optimization.stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "needs zero_optimization.offload_optimizer.nvme_path"),
    ({"tensor_parallel": {"size": 2}}, "tensor_parallel.size = 2 needs tensor_parallel.plan"),
    ({"pipeline_parallel": {"size": 2}, "zero_optimization": {"stage": 3}},
     "pipeline_parallel.size = 2 with zero_optimization.stage 3"),
    ({"pipeline_parallel": {"size": 2}}, "= 2 does not divide the world size 1"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, "* data-parallel size (1) = 4"),
    ({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2}, "is not divisible by"),
    ({"gradient_accumulation_steps": 4}, "alone does not set the batch size"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
    ({"zero_optimization": {"stag": 1}}, "did you mean 'zero_optimization.stage'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
     "is 'auto'"),
    ({"optimizer": {"type": "MuAdam"}}, "DeepSpeed optimizer meshzero does not implement"),
]


def _initialize_error(config_path: str) -> str:
    try:
        meshzero.initialize(model=build_model("mlp"), config=config_path)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _estimate_error(capsys, config_path: str, gpus: int) -> str:
    code = main(["estimate", "--params", "1M", "--gpus-per-node", str(gpus),
                 "--config", config_path])
    err = capsys.readouterr().err
    prefix = "meshzero estimate: error: "
    assert code == 1 and err.startswith(prefix), err
    return err[len(prefix):].rstrip("\n")


@pytest.fixture
def own_world():
    """initialize() makes a world of one in this process; leave no group behind for the
    tests that need a process without one."""
    had_group = dist.is_initialized()
    yield
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()


@pytest.mark.usefixtures("own_world")
def test_estimate_refuses_what_initialize_refuses(tmp_path, capsys):
    for i, (config, want) in enumerate(BAD_CONFIGS):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(config))
        engine_message = _initialize_error(str(path))
        assert want in engine_message, (config, engine_message)
        assert _estimate_error(capsys, str(path), gpus=1) == engine_message, config


def _pipeline_batches_error(rank: int, world_size: int, config_path: str) -> str:
    return _initialize_error(config_path)


def test_pipeline_micro_batches_refused_alike_on_two_ranks(tmp_path, capsys):
    """With pipelining the micro-batches are the accumulation steps: a config whose batch
    resolves (on dp 1) to other accumulation steps is refused by both, at world size 2."""
    path = tmp_path / "pp.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "pipeline_parallel": {"size": 2, "micro_batches": 4}}))
    messages = run_distributed(_pipeline_batches_error, 2, tmp_path, str(path))
    assert "pipeline_parallel.micro_batches (4) != the gradient accumulation steps (1" \
        in messages[0]
    assert messages[0] == messages[1] == _estimate_error(capsys, str(path), gpus=2)


def test_flags_are_validated_as_config_keys():
    """A flag is a config key: refused with the key's own message."""
    from meshzero.estimate import settings_from_config

    with pytest.raises(meshzero.ConfigError, match="offload_param.device = 'cpu' needs "
                       "zero_optimization.stage 3"):
        settings_from_config(None, 1, stage=2, offload_param="cpu")
    with pytest.raises(meshzero.ConfigError, match=r"zero_optimization.stage = 4: Input should "
                       "be less than or equal to 3"):
        settings_from_config({"zero_optimization": {"stage": 1}}, 1, stage=4)
    base = settings_from_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                 "zero_optimization": {"stage": 3}}, 4)
    assert (base.micro_batch, base.grad_accum, base.stage) == (4, 2, 3)
    assert base.replace(micro_batch=2).grad_accum == 2  # the flag re-spells the batch per rank
    with pytest.raises(ValueError, match="unknown estimate setting"):
        base.replace(stages=2)

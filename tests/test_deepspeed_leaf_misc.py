"""The small leaf modules of ``meshzero.deepspeed``: accelerator (DeepSpeed's
accelerator/cpu_accelerator.py, cuda_accelerator.py), arguments (deepspeed/__init__.py
_add_core_arguments, runtime/lr_schedules.py add_tuning_arguments), utils.logging
(utils/logging.py log_dist), utils.groups (utils/groups.py), runtime.config
(runtime/config.py DeepSpeedConfig) and moe (moe/utils.py, moe/layer.py)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshzero
import meshzero.deepspeed as deepspeed
from meshzero.config import ConfigError
from meshzero.deepspeed.moe.layer import MoE
from meshzero.deepspeed.moe.utils import (
    is_moe_param,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
)
from meshzero.deepspeed.utils import groups
from tests.distributed import run_distributed
from tests.models import make_batches, split_for_rank


def test_cpu_accelerator_answers_as_deepspeeds(monkeypatch):
    """CPU_Accelerator: device name 'cpu', gloo, memory = the process RSS (DeepSpeed's
    get_rss) with a peak that only grows until reset, total/available from the host."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    from meshzero.deepspeed.accelerator.devices import CPU_Accelerator

    acc = CPU_Accelerator()
    assert (acc.device_name(), acc.device_name(3), acc.current_device_name()) == ("cpu",) * 3
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and acc.device_count() >= 1
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB resident
    used = acc.memory_allocated()
    assert used > 64 * 2**20 and acc.max_memory_allocated() >= used
    assert 0 < acc.available_memory() <= acc.total_memory()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() <= used + 2**20
    assert acc.on_accelerator(blob) and acc.pin_memory(blob) is blob
    acc.manual_seed(3)
    state = acc.get_rng_state()
    a = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(2))
    with acc.stream(acc.Stream):
        acc.synchronize()
    with pytest.raises(NotImplementedError, match="FusedAdam"):
        acc.create_op_builder("CPUAdamBuilder")
    if not torch.cuda.is_available():
        assert deepspeed.get_accelerator()._name == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accelerator_answers_as_deepspeeds():
    """CUDA_Accelerator (accelerator/cuda_accelerator.py): 'cuda' / 'cuda:N', nccl, the
    device count, synchronize, and the caching allocator's memory counters."""
    from meshzero.deepspeed.accelerator.devices import CUDA_Accelerator

    acc = CUDA_Accelerator()
    assert (acc.device_name(), acc.device_name(0)) == ("cuda", "cuda:0")
    assert acc.device_count() == torch.cuda.device_count() and acc.is_available()
    assert acc.communication_backend_name() == "nccl"
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    blob = torch.ones(64 * 2**20 // 4, device="cuda")  # 64 MiB
    acc.synchronize()
    assert acc.memory_allocated() - before >= 64 * 2**20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert 0 < acc.available_memory() <= acc.total_memory()
    assert acc.on_accelerator(blob) and not acc.on_accelerator(blob.cpu())
    assert deepspeed.get_accelerator().device_name() == "cuda"


def test_add_config_arguments_parses_deepspeeds_flags():
    """The flags DeepSpeed's _add_core_arguments adds, with its defaults; the tuning flags of
    add_tuning_arguments."""
    parser = deepspeed.add_tuning_arguments(deepspeed.add_config_arguments(
        argparse.ArgumentParser()))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json",
                              "--warmup_num_steps", "7"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    assert not args.deepscale and args.deepscale_config is None
    assert args.warmup_num_steps == 7 and args.lr_schedule is None
    assert args.warmup_type == "log" and not args.cycle_momentum


def _rank_logs(rank: int, world: int) -> list:
    from meshzero.deepspeed.utils.logging import log_dist, logger

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log_dist("to rank 0", ranks=[0])
    log_dist("to all", ranks=[-1])
    log_dist("to nobody")  # DeepSpeed's get_dist_msg: ranks=None logs nowhere once dist is up
    logger.warning_once("once")  # type: ignore[attr-defined]
    logger.warning_once("once")  # type: ignore[attr-defined]
    return [seen, groups._get_data_parallel_world_size(), groups._get_model_parallel_world_size(),
            groups._get_expert_parallel_world_size("ep_size_1"),
            dist.get_world_size(groups._get_data_parallel_group())]


def test_log_dist_and_groups(tmp_path):
    """log_dist's ranks (DeepSpeed's get_dist_msg: '[Rank r] ' prefix, [-1] for all) and the
    groups real code asks for: data parallel = the world, model and expert parallel = 1."""
    results = run_distributed(_rank_logs, 2, tmp_path)
    assert results[0][0] == ["[Rank 0] to rank 0", "[Rank 0] to all", "once"]
    assert results[1][0] == ["[Rank 1] to all", "once"]
    assert results[1][1:] == [2, 1, 1, 2]


def test_deepspeed_config_reads_as_deepspeeds():
    """DeepSpeedConfig's attributes (runtime/config.py _initialize_params,
    _configure_train_batch_size): batch sizes resolved for the world, zero stage, precision,
    optimizer name lower-cased; a bad key raises DeepSpeedConfigError, a ConfigError."""
    from meshzero.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    cfg = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                           "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (8, 4, 2)
    assert cfg.zero_optimization_stage == 3 and cfg.zero_enabled and cfg.zero_config.stage == 3
    assert cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 1e-3}
    assert issubclass(DeepSpeedConfigError, ConfigError)
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage"):
        DeepSpeedConfig({"zero_optimization": {"stag": 3}})


class _TinyMoE(nn.Module):
    """A gate and two experts in plain torch; the experts' parameters carry DeepSpeed's
    expert marker (allreduce=False, group_name), as its Experts module sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(7, 8)
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 5)
        for p in self.experts.parameters():
            p.allreduce = False
            p.group_name = "ep_size_1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 7) -> (B, 5)
        h = self.input(x)
        weights = torch.softmax(self.gate(h), dim=-1)  # (B, 2)
        mixed = sum(weights[:, i:i + 1] * e(h) for i, e in enumerate(self.experts))
        return self.head(torch.tanh(mixed))


def _groups(model: nn.Module) -> list[dict]:
    base = [{"params": [p for n, p in model.named_parameters() if "bias" not in n],
             "name": "decay", "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if "bias" in n],
             "name": "no_decay", "weight_decay": 0.0}]
    return split_params_into_different_moe_groups_for_optimizer(base, max_group_size=70)


def _build_moe() -> _TinyMoE:
    torch.manual_seed(0)
    return _TinyMoE()


def test_moe_group_split():
    """split_params_into_different_moe_groups_for_optimizer: shared params stay, experts move
    to 'moe' groups named by group_name with their group's hyperparameters, cut at
    max_group_size elements; grads split the same way; MoE raises naming meshzero's way."""
    model = _build_moe()
    split = _groups(model)
    experts = {id(p) for p in model.experts.parameters()}
    assert [g.get("moe", False) for g in split] == [False, False, True, True, True]
    assert all(id(p) not in experts for g in split[:2] for p in g["params"])
    assert [len(g["params"]) for g in split[2:]] == [1, 1, 2]  # 64-element weights, 70 cap
    assert {g["weight_decay"] for g in split[2:]} == {0.1, 0.0}
    assert all(g["name"] == "ep_size_1" for g in split[2:])
    assert sum(map(is_moe_param, model.parameters())) == 4
    model(torch.randn(3, 7)).sum().backward()
    shared, expert = split_params_grads_into_shared_and_expert_params(model.parameters())
    assert (len(shared), len(expert)) == (6, 4)
    with pytest.raises(NotImplementedError, match="plain torch"):
        MoE(8, nn.Linear(8, 8), num_experts=2)


def _train_moe(rank: int, world: int) -> dict:
    model = _build_moe()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, eps=1e-4)
    engine, _, _, _ = meshzero.initialize(model=model, optimizer=opt, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}})
    for x, y in make_batches("mlp", 3, 8):
        xs, ys = split_for_rank((x, y), rank, world, 1, 0)
        engine.backward(nn.functional.mse_loss(engine(xs), ys))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_moe_groups_train_as_plain_torch(tmp_path, world_size):
    """The split groups under meshzero.initialize (stage 2) give plain torch AdamW's
    parameters on the whole batch: meshzero trains the experts data-parallel."""
    got = run_distributed(_train_moe, world_size, tmp_path)[0]
    model = _build_moe()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, eps=1e-4, foreach=False)
    for x, y in make_batches("mlp", 3, 8):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for name, value in model.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-5, atol=1e-6)

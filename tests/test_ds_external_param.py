"""``deepspeed.zero.register_external_parameter``: a module whose forward uses another
module's parameter trains as plain torch at stage 3, registered or not.

DeepSpeed (``register_external_parameter`` in deepspeed/runtime/zero/partition_parameters.py)
needs the call so that its stage-3 hooks gather ``parameter`` around ``module``'s forward
and backward: it only gathers a module's own parameters. meshzero gathers a stage-3
parameter wherever it is used (zero/param_access.py), so the call has nothing to do and
returns; this test holds both, with and without the call, to plain torch at W = 1, 2, 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshzero.deepspeed as deepspeed
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS

LR, WD, BATCH, STEPS = 1e-2, 0.01, 8, 3


class Mix(nn.Module):
    """Its forward reads a weight it does not own (the embedding of a tied head, a shared
    projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, external: torch.Tensor) -> torch.Tensor:
        return self.w(h) + F.linear(h, external)


class Net(nn.Module):
    def __init__(self, register: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.mix = Mix()
        self.out = nn.Linear(8, 3)
        if register:
            deepspeed.zero.register_external_parameter(self.mix, self.lin1.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(self.mix(h, self.lin1.weight))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _plain() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(register=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=WD,
                            foreach=False)
    for x, y in _batches():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for register in (True, False):
        torch.manual_seed(0)
        model = Net(register)
        cfg = {"train_batch_size": BATCH,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": ADAM_EPS,
                                                         "weight_decay": WD}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
        n = BATCH // world
        for x, y in _batches():
            engine.backward(F.cross_entropy(engine(x[rank * n:(rank + 1) * n]),
                                            y[rank * n:(rank + 1) * n]))
            engine.step()
        out.append(engine.full_state_dict())
        engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_external_parameter_trains_as_plain_torch(tmp_path, world_size):
    want = _plain()
    for per_rank in run_distributed(_train, world_size, tmp_path, timeout=240):
        for got in per_rank:  # registered, then not
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_register_checks_its_argument_as_deepspeed_does():
    """DeepSpeed raises RuntimeError for a ``parameter`` that is not an ``nn.Parameter``."""
    with pytest.raises(RuntimeError, match="Parameter"):
        deepspeed.zero.register_external_parameter(nn.Linear(2, 2), torch.zeros(2))

"""Progressive layer drop: the engine passes DeepSpeed's keywords and theta schedule to the
model's training forward; training equals a plain-torch replay that passes the same.

DeepSpeed (0.19.6): ``ProgressiveLayerDrop.get_state`` / ``update_state``
(runtime/progressive_layer_drop.py): ``{"progressive_layer_drop": True, "pld_theta":
theta}``, theta 1.0 at first, ``(1 - theta) exp(-gamma t) + theta`` after ``update_state(t)``;
``DeepSpeedEngine.forward`` adds them to the kwargs of a training forward and
``DeepSpeedEngine.step`` calls ``update_state(global_steps)`` on each
accumulation boundary before the optimizer step (runtime/engine.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import meshzero
from tests.distributed import run_distributed
from tests.models import make_batches, mlp_loss, split_for_rank

STEPS, BATCH, THETA, GAMMA = 4, 8, 0.5, 0.7


class LayerDropNet(nn.Module):
    """Residual tanh blocks scaled by the keep probability (a deterministic stand-in for
    dropping each block with probability 1 - theta); records what it was passed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.input = nn.Linear(7, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 5)
        self.seen: list[tuple[bool, float]] = []

    def forward(self, x: torch.Tensor, progressive_layer_drop: bool = False,
                pld_theta: float = 1.0) -> torch.Tensor:  # (B, 7) -> (B, 5)
        self.seen.append((progressive_layer_drop, pld_theta))
        keep = pld_theta if progressive_layer_drop else 1.0
        h = self.input(x)
        for block in self.blocks:
            h = h + keep * torch.tanh(block(h))
        return self.head(h)


def _config() -> dict:
    return {"train_batch_size": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-4}},
            "progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": GAMMA}}


def thetas() -> list[float]:
    """The theta of each step's forward: 1.0, then update_state(step - 1)."""
    return [1.0] + [(1 - THETA) * math.exp(-GAMMA * t) + THETA for t in range(STEPS - 1)]


def _train(rank: int, world_size: int) -> tuple[dict, list]:
    model = LayerDropNet()
    engine, _, _, _ = meshzero.initialize(model=model, config=_config())
    for batch in make_batches("mlp", STEPS, BATCH):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    engine.eval()
    with torch.no_grad():
        engine(torch.zeros(1, 7))  # not a training forward: no keywords
    state = engine.full_state_dict()
    engine.close()
    return state, model.seen


# W = 2 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    2,
    pytest.param(4, marks=pytest.mark.slow)])
def test_layer_drop_equals_plain_replay(tmp_path, world_size):
    ref = LayerDropNet()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4, foreach=False)
    for batch, theta in zip(make_batches("mlp", STEPS, BATCH), thetas(), strict=True):
        mlp_loss(ref(batch[0], progressive_layer_drop=True, pld_theta=theta), batch[1]).backward()
        opt.step()
        opt.zero_grad()
    for state, seen in run_distributed(_train, world_size, tmp_path, timeout=300):
        assert seen[:-1] == [(True, pytest.approx(t, rel=1e-12)) for t in thetas()]
        assert seen[-1] == (False, 1.0)
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def test_layer_drop_refuses_a_forward_without_the_keywords():
    with pytest.raises(ValueError, match="pld_theta"):
        meshzero.initialize(model=nn.Linear(7, 5), config=_config())


def test_get_pld_theta_under_deepspeed_names():
    """``DeepSpeedEngine.get_pld_theta`` (runtime/engine.py): the current theta."""
    import meshzero.deepspeed as deepspeed

    engine, _, _, _ = deepspeed.initialize(model=LayerDropNet(), config=_config())
    try:
        assert engine.get_pld_theta() == 1.0
        x, y = make_batches("mlp", 1, BATCH)[0]
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
        assert engine.get_pld_theta() == pytest.approx(thetas()[2])
    finally:
        engine.close()

"""The estimator and parameters unfrozen after ``initialize`` (issue 26, item 1): a group
frozen at initialize holds only its parameters; once one of its parameters is unfrozen the
engine makes the whole group trainable with its own layout and padding
(zero/trainability.py). ``estimate(..., trainable="all")`` (``meshzero estimate --trainable
all``) gives the model states then, equal to ``engine.memory_report()`` after a real
unfreeze, to the byte, for every rank (stages 0-3, CPU offload, bf16); the default estimate
shows that figure beside its own when the model has frozen parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshzero
from meshzero.cli import main
from meshzero.estimate import Cluster, Estimator, estimate, load_model, settings_from_config
from meshzero.estimate.plan import plan
from meshzero.estimate.states import total_bytes
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import Block
from tests.test_estimate import tiny_gpt

# (stage, offload_optimizer, bf16); "nvme+param": offload_param nvme too
CASES = [(0, "none", False), (1, "none", False), (2, "none", False), (3, "none", False),
         (1, "cpu", False), (3, "cpu", True), (2, "none", True), (3, "nvme", False),
         (1, "nvme", True), (3, "nvme+param", False)]


def _config(world: int, stage: int, offload: str, bf16: bool, path: str) -> dict:
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    device = offload.split("+")[0]
    tier = {"device": device, **({"nvme_path": path} if device == "nvme" else {})}
    zero = {"offload_optimizer": tier, **({"offload_param": tier} if "+param" in offload
                                          else {})}
    return zero_config(stage, global_batch=2 * world, zero_optimization=zero, **extra)


class PartlyFrozen(nn.Module):
    """Odd widths (padding in every group); the input layer and the first two of three
    blocks frozen at initialize: frozen groups in the root unit and in two block units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 13)
        self.blocks = nn.ModuleList(Block(13, 29) for _ in range(3))
        self.out = nn.Linear(13, 3)
        for module in (self.inp, self.blocks[0], self.blocks[1]):
            module.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _step(engine, gen: torch.Generator) -> None:
    x = torch.randn(2, 5, generator=gen)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _reports(rank: int, world: int, path: str) -> list[tuple[dict, dict]]:
    """Per case: memory_report() after a step with the backbone frozen, and after a step
    with every parameter unfrozen."""
    out = []
    for case in CASES:
        torch.manual_seed(0)
        model = PartlyFrozen()
        engine, *_ = meshzero.initialize(model=model, config=_config(world, *case, path))
        gen = torch.Generator().manual_seed(rank)
        _step(engine, gen)
        frozen = engine.memory_report()
        model.requires_grad_(True)
        _step(engine, gen)
        out.append((frozen, engine.memory_report()))
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_trainable_all_equals_memory_report_after_unfreezing(tmp_path, world_size):
    measured = run_distributed(_reports, world_size, tmp_path, str(tmp_path), timeout=240)
    estimator = Estimator(load_model(PartlyFrozen))
    cluster = Cluster(nodes=1, gpus_per_node=world_size)
    for i, case in enumerate(CASES):
        config, stage = _config(world_size, *case, str(tmp_path)), case[0]
        as_built = settings_from_config(config, world_size)
        unfrozen = settings_from_config(config, world_size, trainable="all")
        for rank in range(world_size):
            frozen_got, unfrozen_got = measured[rank][i]
            want = estimator.states(as_built, world_size).report(rank)
            assert want == {k: frozen_got[k] for k in want}, (case, rank)
            want = estimator.states(unfrozen, world_size).report(rank)
            assert want == {k: unfrozen_got[k] for k in want}, (case, rank)
        # the default estimate carries the unfrozen figure of the rank holding the most
        est = estimator.estimate(as_built, cluster, search_micro_batch=False)
        assert est.unfrozen_states is not None
        most = max(sum(sum(got[1][k].values()) for k in est.unfrozen_states)
                   for got in (measured[r][i] for r in range(world_size)))
        assert total_bytes(est.unfrozen_states) == most
        if stage >= 1:  # masters/gradients/states of the unfrozen groups: more than before
            assert total_bytes(est.unfrozen_states) > total_bytes(est.model_states)


def test_report_shows_the_unfrozen_figure_and_the_flag_validates():
    frozen = estimate(PartlyFrozen, stage=3, cluster=Cluster(gpus_per_node=2))
    text = str(frozen)
    assert "after unfreezing the frozen parameters (--trainable all)" in text
    every = estimate(PartlyFrozen, stage=3, cluster=Cluster(gpus_per_node=2), trainable="all")
    assert every.unfrozen_states is None
    assert every.model_states == frozen.unfrozen_states
    assert "every parameter trainable" in str(every)
    plain = estimate(lambda: nn.Sequential(nn.Linear(5, 13), Block(13, 29), Block(13, 29)),
                     stage=3, cluster=Cluster(gpus_per_node=2))
    assert plain.unfrozen_states is None and "after unfreezing" not in str(plain)
    with pytest.raises(ValueError, match=r"trainable must be one of \['initialize', 'all', "
                                         r"'none'\], got 'some'"):
        estimate(PartlyFrozen, stage=3, trainable="some")


def frozen_gpt() -> nn.Module:
    """tests/test_estimate.py's tiny GPT with every block but the last frozen at initialize
    (a backbone to unfreeze later)."""
    model = tiny_gpt()
    for block in list(model.blocks)[:-1]:
        block.requires_grad_(False)
    return model


def test_plan_sizes_every_candidate_with_the_trainable_flag(capsys):
    """``meshzero plan --trainable all``: every candidate is estimated with the frozen
    groups trainable, as ``estimate --trainable all`` sizes them, so a plan for a run that
    unfreezes its backbone fits after the unfreeze too."""
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory="3MB", host_memory="1GB")
    as_frozen = plan(frozen_gpt, cluster=cluster, persistence_threshold=0)
    unfrozen = plan(frozen_gpt, cluster=cluster, persistence_threshold=0, trainable="all")

    def states(p):
        return {(c.estimate.settings.stage, c.estimate.settings.offload_optimizer,
                 c.estimate.settings.offload_param, c.estimate.settings.micro_batch):
                total_bytes(c.estimate.model_states) for c in p.candidates}

    before, after = states(as_frozen), states(unfrozen)
    assert all(c.estimate.settings.trainable == "all" for c in unfrozen.candidates)
    both = set(before) & set(after)
    assert both and all(after[k] > before[k] for k in both if k[0] >= 1), (before, after)
    assert main(["plan", "tests.test_estimate_trainable:frozen_gpt", "--gpus-per-node", "4",
                 "--gpu-memory", "3MB", "--host-memory", "1GB", "--trainable", "all",
                 "--top", "0"]) == 0
    assert "note: every parameter trainable" in capsys.readouterr().out

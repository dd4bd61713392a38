"""DeepSpeed's ``exp_avg_mask`` param-group key for the 1-bit family: the mask multiplies
what each compressed all-reduce gives for its group, so elements no batch reaches keep an
exact zero momentum (1-bit signs cannot carry a zero). Each optimizer equals its plain
replay with the mask, at W = 1, 2 and 4.

Where DeepSpeed applies it (DeepSpeed 0.19.6, runtime/fp16/onebit/): ``OnebitAdam.step``
multiplies ``exp_avg`` by the mask after ``compressed_allreduce`` in every compressed step
(at one rank too); ``OnebitLamb.step`` multiplies each momentum after the compressed
all-reduce and the scaling are undone; ``ZeroOneAdam.step`` multiplies the 1-bit mean of the
gradient (variance phase) and of the synchronised accumulator, at more than one rank.
DeepSpeedExamples' bing_bert builds the group ``{"params": [position_embeddings.weight],
"exp_avg_mask": mask}``; here the mask covers a group's parameters in their order.
"""

from __future__ import annotations

import pytest
import torch

import meshzero
from tests import test_onebit, test_onebit_lamb, test_zeroone
from tests.distributed import run_distributed
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

KINDS = {"OneBitAdam": (test_onebit, test_onebit.PARAMS, test_onebit.STEPS),
         "OneBitLamb": (test_onebit_lamb, test_onebit_lamb.PARAMS, test_onebit_lamb.STEPS),
         "ZeroOneAdam": (test_zeroone, test_zeroone.PARAMS, test_zeroone.STEPS)}
BATCH = 8


def _mask() -> torch.Tensor:
    """Zeros over the first 40 elements (rows of the first weight) and a band in the middle."""
    numel = sum(p.numel() for p in build_model("mlp", 0).parameters())
    mask = torch.ones(numel)
    mask[:40] = 0.0
    mask[numel // 2:numel // 2 + 30] = 0.0
    return mask


def _train(rank: int, world: int, kind: str) -> list[torch.Tensor]:
    _, params, steps = KINDS[kind]
    model = build_model("mlp", 0)
    groups = [{"params": list(model.parameters()), "exp_avg_mask": _mask()}]
    engine, *_ = meshzero.initialize(model=model, model_parameters=groups, config={
        "train_batch_size": BATCH, "optimizer": {"type": kind, "params": params}})
    history = []
    for batch in make_batches("mlp", steps, BATCH):
        x, y = split_for_rank(batch, rank, world, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
        history.append(torch.cat([t.reshape(-1) for t in engine.full_state_dict().values()]))
    engine.close()
    return history


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_exp_avg_mask_equals_the_replay(tmp_path, kind, world_size):
    module = KINDS[kind][0]
    want = module.reference(world_size, mask=_mask())
    if kind == "OneBitLamb":
        want = want[0]  # (history, coefficients)
    unmasked = module.reference(world_size)
    unmasked = unmasked[0] if kind == "OneBitLamb" else unmasked
    last = want[-1] if kind != "ZeroOneAdam" else want[-1][0]
    plain_last = unmasked[-1] if kind != "ZeroOneAdam" else unmasked[-1][0]
    if not (kind == "ZeroOneAdam" and world_size == 1):  # nothing compressed: no mask
        assert (last - plain_last).abs().max().item() > 1e-4  # the mask changed the run
    for rank, got in enumerate(run_distributed(_train, world_size, tmp_path, kind,
                                               timeout=300)):
        for step, g in enumerate(got):
            w = want[step][rank] if kind == "ZeroOneAdam" else want[step]
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")


def test_exp_avg_mask_of_the_wrong_size_and_non_freeze_are_refused():
    from meshzero.optimizers import OneBitAdam, OneBitLamb, ZeroOneAdam

    p = torch.nn.Parameter(torch.zeros(3))
    for cls in (OneBitAdam, ZeroOneAdam, OneBitLamb):
        with pytest.raises(ValueError, match="exp_avg_mask has 4 elements, its parameters 3"):
            cls([{"params": [p], "exp_avg_mask": torch.ones(4)}])
        with pytest.raises(ValueError, match="exp_avg_mask is a list, not a tensor"):
            cls([{"params": [p], "exp_avg_mask": [1, 1, 1]}])
        with pytest.raises(ValueError, match="param group 0: 'non_freeze' is not supported"):
            cls([{"params": [p], "non_freeze": True}])

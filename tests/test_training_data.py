"""``initialize(training_data=...)``: the distributed loader it gives back (meshzero.data).

DeepSpeed's ``DeepSpeedEngine.deepspeed_io`` (runtime/engine.py) builds a
``DeepSpeedDataLoader`` (runtime/dataloader.py) of micro-batches per rank over a
``DistributedSampler`` of the data-parallel ranks (shuffled, seed 0, ``dataloader_drop_last``);
``PipelineEngine._build_data_iter`` / ``train_batch`` (runtime/pipe/engine.py) read it through
a ``RepeatingLoader`` when ``train_batch()`` gets no ``data_iter``, unshuffled. The tests hold
each rank's micro-batches and the training through them to plain torch on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import meshzero
from meshzero.data import Repeating, training_loader
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import build_model, mlp_loss, reference_train

SAMPLES, MICRO, GAS, LR = 32, 2, 2, 1e-2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(SAMPLES, 7, generator=gen), torch.randn(SAMPLES, 5, generator=gen)


def _collate(samples: list) -> dict[str, torch.Tensor]:
    """A collate_fn that keeps each sample's index, to see who read what."""
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples]),
            "idx": torch.stack([s[2] for s in samples])}


def _train_epoch(rank: int, world_size: int) -> dict:
    """One epoch of engine(batch) over the loader initialize gives back; the micro batch is
    "auto", taken from the DataLoader passed as training_data."""
    x, y = _data()
    data = DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=MICRO, shuffle=True)
    cfg = zero_config(2, global_batch=0, grad_accum=GAS, lr=LR)
    del cfg["train_batch_size"]
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    engine, _, loader, _ = meshzero.initialize(model=build_model("mlp"), config=cfg,
                                               training_data=data, collate_fn=_collate)
    assert loader is engine.training_dataloader
    assert engine.train_batch_size() == MICRO * GAS * world_size
    seen, norms = [], []
    for batch in loader:
        engine.backward(mlp_loss(engine(batch["x"]), batch["y"]))
        if engine.step():
            norms.append(engine.last_grad_norm)
        seen.append(batch["idx"].tolist())
    state = engine.full_state_dict()
    return {"seen": seen, "norms": norms, "state": state if rank == 0 else None}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_reads_its_micro_batches_and_trains_as_plain_torch(run_ranks, world_size):
    """DeepSpeed's ``deepspeed_io`` / ``DeepSpeedDataLoader``: DistributedSampler over the dp
    ranks (shuffle, seed 0), micro batch per rank; ``_take_model_step`` /
    ``get_global_grad_norm``: the norm of every step, unclipped."""
    results = run_ranks(_train_epoch, world_size)
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for rank, res in enumerate(results):  # DistributedSampler's order: perm[rank::W]
        mine = perm[rank::world_size]
        assert res["seen"] == [mine[i:i + MICRO] for i in range(0, len(mine), MICRO)]
    everyone = [i for res in results for mb in res["seen"] for i in mb]
    assert sorted(everyone) == list(range(SAMPLES))  # disjoint, and all of it
    x, y = _data()
    steps = len(results[0]["seen"]) // GAS
    batches = []
    for s in range(steps):  # the global batch of step s: every rank's GAS micro-batches
        idx = [i for res in results for mb in res["seen"][s * GAS:(s + 1) * GAS] for i in mb]
        batches.append((x[idx], y[idx]))
    ref = reference_train(lambda: build_model("mlp"), batches, lr=LR, eps=ADAM_EPS)
    for name, want in ref.params.items():
        torch.testing.assert_close(results[0]["state"][name], want, rtol=1e-5, atol=1e-6)
    for res in results:
        torch.testing.assert_close(res["norms"], ref.grad_norms, rtol=1e-5, atol=1e-7)


def _pipeline_from_data(rank: int, world_size: int) -> dict:
    """pp 2 x dp 2: train_batch() with no data_iter reads initialize's loader."""
    from tests.test_pipeline import _mlp_chain

    x, y = _data()
    cfg = zero_config(1, global_batch=2 * MICRO * GAS, grad_accum=GAS, lr=LR,
                      pipeline_parallel={"size": 2, "schedule": "1f1b"})
    engine, _, loader, _ = meshzero.initialize(
        model=_mlp_chain(), config=cfg, training_data=TensorDataset(x, y), loss_fn=mlp_loss,
        example_inputs=x[:MICRO])
    steps = SAMPLES // (2 * MICRO * GAS) + 1  # past one pass: the loader restarts
    for _ in range(steps):
        engine.train_batch()
    from tests.test_mesh_parallel import _full_params

    return {"params": _full_params(engine), "dp_rank": engine.topology.dp_rank,
            "steps": steps, "batches": len(loader)}


def test_train_batch_without_data_iter_reads_the_loader(run_ranks):
    """DeepSpeed's ``PipelineEngine.train_batch``: ``data_iter`` None reads the loader of
    ``_build_data_iter`` (DistributedSampler over dp, shuffle False, RepeatingLoader)."""
    results = run_ranks(_pipeline_from_data, 4)
    assert {r["dp_rank"] for r in results} == {0, 1}
    x, y = _data()
    per_rank = [list(range(SAMPLES))[r::2] for r in range(2)]  # unshuffled, by dp rank
    per_step = MICRO * GAS
    batches = []
    for s in range(results[0]["steps"]):
        idx = []
        for mine in per_rank:
            start = (s * per_step) % len(mine)  # a pass holds len(mine) / per_step steps
            idx += mine[start:start + per_step]
        batches.append((x[idx], y[idx]))
    from tests.test_pipeline import _mlp_chain

    ref = reference_train(_mlp_chain, batches, lr=LR, eps=ADAM_EPS)
    for name, want in ref.params.items():
        torch.testing.assert_close(results[0]["params"][name], want, rtol=1e-5, atol=1e-6)


def test_the_loader_advances_its_epoch_and_repeats():
    """Each pass of the loader is a new epoch of the sampler (DeepSpeed's never sets one);
    Repeating (DeepSpeed's ``RepeatingLoader``) restarts it."""
    x, y = _data()
    loader = training_loader(TensorDataset(x, y, torch.arange(SAMPLES)), micro_batch=4,
                             dp_rank=1, dp_size=2, collate_fn=_collate)
    first = [b["idx"].tolist() for b in loader]
    second = [b["idx"].tolist() for b in loader]
    assert len(first) == len(loader) == 4
    assert first != second and len(set(sum(second, []))) == SAMPLES // 2  # a new order
    endless = Repeating(loader)
    assert len([next(endless) for _ in range(9)]) == 9


def test_bad_training_data_is_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(3)

    with pytest.raises(ValueError, match="map-style torch Dataset"):
        training_loader(Stream(), micro_batch=2, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="map-style torch Dataset"):
        training_loader([1, 2, 3], micro_batch=2, dp_rank=0, dp_size=1)
    x, y = _data()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1}}}
    with pytest.raises(ValueError, match="DataLoader with batch_size 3, but the micro batch is 4"):
        meshzero.initialize(model=build_model("mlp"), config=cfg,
                            training_data=DataLoader(TensorDataset(x, y), batch_size=3))


def test_deepspeed_dataloader_and_repeating_loader():
    """DeepSpeed's ``DeepSpeedDataLoader.__init__`` (runtime/dataloader.py): with
    ``local_rank >= 0`` a ``DistributedSampler(dataset, num_replicas, rank)`` (shuffled, seed
    0, never set_epoch), ``tput_timer.start()`` per batch, curriculum learning via its
    config; ``RepeatingLoader.__next__`` restarts on StopIteration."""
    from meshzero.deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader

    starts = []
    timer = type("Timer", (), {"start": lambda self: starts.append(1)})()
    x, y = _data()
    data = TensorDataset(x, y, torch.arange(SAMPLES))
    loader = DeepSpeedDataLoader(data, batch_size=4, pin_memory=False, local_rank=0,
                                 tput_timer=timer, collate_fn=_collate, num_local_io_workers=0,
                                 data_parallel_world_size=2, data_parallel_rank=1)
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()[1::2]
    got = [b["idx"].tolist() for b in loader]
    assert got == [perm[i:i + 4] for i in range(0, 16, 4)] and len(loader) == 4
    assert len(starts) == 5  # as DeepSpeed: also before the next() that ends the pass
    again = RepeatingLoader([1, 2, 3])
    assert [next(again) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(NotImplementedError, match="curriculum_learning"):
        DeepSpeedDataLoader(data, 2, False, 0, None,
                            deepspeed_dataloader_config={"curriculum_learning": True})

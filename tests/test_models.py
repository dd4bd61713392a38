"""Sanity of the tiny models, the data and the plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.models import (
    MLPStack,
    TrickyModel,
    build_model,
    loss_fn_for,
    make_batches,
    reference_train,
    split_for_rank,
)


@pytest.mark.parametrize("kind", ["mlp", "tricky"])
def test_models_build_deterministically_and_run(kind):
    a, b = build_model(kind, seed=3), build_model(kind, seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].fc1.weight, build_model(kind, seed=4).blocks[0].fc1.weight)
    x, y = make_batches(kind, num_steps=1, global_batch=8, seed=0)[0]
    out = a(x)
    assert out.shape == (y.shape if kind == "mlp" else (*y.shape, 29))
    assert torch.isfinite(loss_fn_for(a)(out, y))


def test_sizes_are_uneven():
    mlp = MLPStack()
    total = sum(p.numel() for p in mlp.parameters())
    root_own = sum(p.numel() for n, p in mlp.named_parameters() if not n.startswith("blocks."))
    assert (total, root_own) == (2733, 213) and total % 2 == 1 and root_own % 2 == 1
    tricky_block = sum(p.numel() for p in TrickyModel().blocks[0].parameters())
    assert tricky_block == 461


def test_tricky_model_tie_frozen_unused_buffer():
    model = build_model("tricky")
    assert model.head.weight is model.embed.weight
    names = [name for name, _ in model.named_parameters()]
    assert "embed.weight" in names and "head.weight" not in names  # tied counted once
    assert [name for name, _ in model.named_buffers()] == ["scale"]
    tokens, targets = make_batches("tricky", 1, 4, seed=0)[0]
    loss_fn_for(model)(model(tokens), targets).backward()
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    for name, p in model.named_parameters():
        if not name.startswith(("frozen.", "unused.")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_blocks0_runs_twice_per_forward():
    model = build_model("tricky")
    calls = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i))
    model(torch.zeros(1, 3, dtype=torch.long))
    assert calls == [0, 1, 2, 0]


@pytest.mark.parametrize("kind", ["mlp", "tricky"])
def test_reference_reduces_loss_and_is_deterministic(kind):
    batches = make_batches(kind, num_steps=10, global_batch=16, seed=1)
    first = reference_train(lambda: build_model(kind), batches)
    again = reference_train(lambda: build_model(kind), batches)
    assert len(first.losses) == len(first.grad_norms) == 10
    assert sum(first.losses[-3:]) / 3 < 0.8 * first.losses[0]
    assert first.losses == again.losses
    for name, p in first.params.items():
        assert torch.equal(p, again.params[name]), name


def test_reference_options_agree():
    batches = make_batches("tricky", num_steps=4, global_batch=12, seed=2)
    base = reference_train(lambda: build_model("tricky"), batches)
    accum = reference_train(lambda: build_model("tricky"), batches, grad_accum=3)
    bf16 = reference_train(lambda: build_model("tricky"), batches, dtype=torch.bfloat16)
    for name, p in base.params.items():
        torch.testing.assert_close(accum.params[name], p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bf16.params[name], p, rtol=0.05, atol=0.02)
        assert bf16.params[name].dtype == torch.float32  # fp32 master is the result
    clipped = reference_train(lambda: build_model("tricky"), batches, clip=0.1)
    assert clipped.grad_norms[0] == base.grad_norms[0] > 0.1
    name = "blocks.0.fc1.weight"
    assert not torch.equal(clipped.params[name], base.params[name])
    initial = build_model("tricky")
    assert torch.equal(base.params["frozen.weight"], initial.frozen.weight)
    # unused params: zero grads by default (weight decay applies), torch's skip if asked
    assert not torch.equal(base.params["unused.weight"], initial.unused.weight)
    skipped = reference_train(lambda: build_model("tricky"), batches, zero_unused_grads=False)
    assert torch.equal(skipped.params["unused.weight"], initial.unused.weight)
    sgd = reference_train(lambda: build_model("tricky"), batches, optimizer="SGD", lr=0.1)
    assert sgd.losses[-1] < sgd.losses[0]


@pytest.mark.parametrize(("world_size", "grad_accum"), [(1, 1), (1, 3), (2, 2), (4, 3)])
def test_split_for_rank_covers_the_global_batch_once(world_size, grad_accum):
    size = 2 * world_size * grad_accum
    batch = (torch.arange(size), torch.arange(size) * 10)
    pieces = [
        split_for_rank(batch, r, world_size, grad_accum, m)
        for r in range(world_size)
        for m in range(grad_accum)
    ]
    assert torch.equal(torch.cat([x for x, _ in pieces]), batch[0])  # contiguous, rank-major
    assert torch.equal(torch.cat([y for _, y in pieces]), batch[1])
    assert all(len(x) == 2 for x, _ in pieces)
    # rank 1's chunk is the second contiguous slice of micro * grad_accum samples
    if world_size > 1:
        first, _ = split_for_rank(batch, 1, world_size, grad_accum, 0)
        assert first[0].item() == 2 * grad_accum


def test_split_for_rank_rejects_bad_sizes():
    batch = (torch.arange(10), torch.arange(10))
    with pytest.raises(ValueError, match="not divisible"):
        split_for_rank(batch, 0, 4, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        split_for_rank(batch, 2, 2, 1, 0)

"""``meshzero.deepspeed.zero``: ZeRO-3 attributes, ``GatheredParameters``, ``Init`` and leaf
modules, as real training code drives them, against plain torch.

DeepSpeed: ``GatheredParameters.__enter__/__exit__`` and ``ZeroParamStatus``
(deepspeed/runtime/zero/partition_parameters.py: the modifier rank's values are broadcast
and partitioned again), ``Init.__init__`` (its keywords), ``set_z3_leaf_modules`` /
``z3_leaf_module`` (deepspeed/utils/z3_leaf_module.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshzero
import meshzero.deepspeed as deepspeed
from meshzero.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from meshzero.deepspeed.utils.z3_leaf_module import set_z3_leaf_modules, z3_leaf_module
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import build_model, make_batches, mlp_loss, split_for_rank


def _values_as_code_reads_them(model: nn.Module) -> dict[str, torch.Tensor]:
    """The ZeRO-3 branch real code takes when it finds ``ds_id`` (else plain reads)."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            assert p.ds_status in (ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE)
            with deepspeed.zero.GatheredParameters([p]):
                value = p.data.clone()
            assert p.ds_shape == value.shape and p.ds_tensor.dim() == 1
        else:
            value = p.data.clone()
        n = p.ds_numel if hasattr(p, "ds_id") else p.numel()
        assert n == value.numel()
        out[name] = value
    return out


def _hf_init_weights(module: nn.Module) -> None:
    """A transformers-style ``_init_weights``: the same values on every rank that runs it."""
    if isinstance(module, nn.Linear):
        torch.manual_seed(7)
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()


def _run_attrs(rank, world_size, stage):
    engine, *_ = meshzero.initialize(model=build_model("mlp"),
                                     config=zero_config(stage, global_batch=8))
    model = engine.module
    read = _values_as_code_reads_them(model)
    # a view taken outside any gathered block (``p.T`` as a hand-written linear reads it)
    # gathers the released parameter as reading ``p.data`` does
    read.update({f"{name}.T": p.T.detach().clone() for name, p in model.named_parameters()
                 if p.dim() == 2})
    has_ds = [hasattr(p, "ds_id") for p in model.parameters()]
    head = model.head
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0):
        if rank == 0:
            _hf_init_weights(head)
    written = engine.full_state_dict()
    for batch in make_batches("mlp", 2, 8):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    return read, has_ds, written, engine.full_state_dict()


def _plain_after_init(steps: int) -> dict[str, torch.Tensor]:
    model = build_model("mlp")
    _hf_init_weights(model.head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False)
    for x, y in make_batches("mlp", steps, 8):
        mlp_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size,stage", [(2, 1), (1, 3), (2, 3), (4, 3)])
def test_zero3_branch_reads_and_writes_as_plain_torch(tmp_path, world_size, stage):
    plain = build_model("mlp").state_dict()
    after_init, trained = _plain_after_init(0), _plain_after_init(2)
    for read, has_ds, written, final in run_distributed(_run_attrs, world_size, tmp_path,
                                                        stage):
        assert all(has_ds) == (stage == 3) and any(has_ds) == (stage == 3)
        for name, want in plain.items():
            torch.testing.assert_close(read[name], want)
            if want.dim() == 2:
                torch.testing.assert_close(read[f"{name}.T"], want.T)
        for name, want in after_init.items():
            torch.testing.assert_close(written[name], want)
        for name, want in trained.items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6)


def _resize_rows(new: nn.Linear, old: nn.Linear) -> None:
    """Weight surgery as transformers' resize_token_embeddings: copy the old rows."""
    n = old.weight.shape[0]
    new.weight.data[:n, :] = old.weight.data[:n, :]
    new.bias.data[:n] = old.bias.data[:n]


def _build_under_init(rank, world_size):
    torch.manual_seed(0)
    cfg = zero_config(3, global_batch=8)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = build_model("mlp")
        wide = nn.Linear(model.head.in_features, model.head.out_features + 2)
    assert wide.weight.is_meta
    with deepspeed.zero.GatheredParameters([wide.weight, wide.bias, model.head.weight,
                                            model.head.bias], modifier_rank=0):
        if rank == 0:
            _resize_rows(wide, model.head)
            wide.bias.data[-2:] = 0.5
    model.head = wide
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    written = engine.full_state_dict()
    for batch in make_batches("mlp", 2, 8):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x)[:, :-2], y))
        engine.step()
    return written, engine.full_state_dict()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_writes_inside_zero_init_reach_the_trained_model(tmp_path, world_size):
    torch.manual_seed(0)
    model = build_model("mlp")
    wide = nn.Linear(model.head.in_features, model.head.out_features + 2)
    with torch.no_grad():
        _resize_rows(wide, model.head)
        wide.bias[-2:] = 0.5
    model.head = wide
    want_written = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False)
    for x, y in make_batches("mlp", 2, 8):
        mlp_loss(model(x)[:, :-2], y).backward()
        opt.step()
        opt.zero_grad()
    for written, final in run_distributed(_build_under_init, world_size, tmp_path):
        for name, want in want_written.items():
            torch.testing.assert_close(written[name], want)
        for name, want in model.state_dict().items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6)


class Experts(nn.Module):
    """An MoE-like block: experts in a ModuleList (each a unit by default), routed by data."""

    def __init__(self, dim: int, n: int = 3):
        super().__init__()
        self.gate = nn.Linear(dim, n)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if mask.any():  # rank-dependent: only a whole-unit gather keeps ranks in step
                out[mask] = expert(x[mask])
        return x + out


def _moe_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), Experts(16), nn.Linear(16, 5))


def _run_moe(rank, world_size):
    model = _moe_model()
    set_z3_leaf_modules(model, [Experts])
    assert z3_leaf_module(model[1])
    engine, *_ = meshzero.initialize(model=model, config=zero_config(3, global_batch=8))
    units = [u.path for u in engine.zero.layout.units]
    for batch in make_batches("mlp", 2, 8):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    return units, engine.full_state_dict()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_leaf_module_is_one_unit_and_trains_as_plain_torch(tmp_path, world_size):
    model = _moe_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False)
    for x, y in make_batches("mlp", 2, 8):
        mlp_loss(model(x), y).backward()
        for p in model.parameters():  # the gate gets no gradient: ZeRO steps it on zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    for units, final in run_distributed(_run_moe, world_size, tmp_path):
        # unmarked, each expert (a ModuleList of repeated Linears) would be a unit
        assert "1" in units and not any(u.startswith("1.") for u in units), units
        for name, want in model.state_dict().items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6)


def test_init_keywords_are_honoured_or_refused():
    with pytest.raises(ValueError, match="zero_optimization.zero_quantized_weights: true"):
        deepspeed.zero.Init(zero_quantized_weights=True)
    deepspeed.zero.Init(zero_quantized_weights=True, config={  # the config says it too
        "train_batch_size": 1, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    with pytest.raises(NotImplementedError, match="module"):
        deepspeed.zero.Init(module=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="compute dtype"):
        deepspeed.zero.Init(config={"train_batch_size": 1, "bf16": {"enabled": True}},
                            dtype=torch.float16)
    # Hugging Face passes its config before "auto" is resolved: the engine's config decides
    deepspeed.zero.Init(config_dict_or_path={"train_batch_size": "auto",
                                             "bf16": {"enabled": "auto"}},
                        dtype=torch.bfloat16)
    with deepspeed.zero.Init(mpu=object(), remote_device="cpu", pin_memory=True,
                             mem_efficient_linear=False, enabled=True):
        assert nn.Linear(2, 2).weight.is_meta
    with deepspeed.zero.Init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta
    p = nn.Parameter(torch.ones(2))
    with deepspeed.zero.GatheredParameters(p, enabled=False, fwd_module=nn.Linear(2, 2)):
        p.data.fill_(3.0)  # not held by an engine, one process: kept as written
    assert p.data.tolist() == [3.0, 3.0]


def _dropped_engine_frees(rank, world_size):
    import gc
    import weakref

    from meshzero.zero.owners import owner_of

    engine, *_ = meshzero.initialize(model=build_model("mlp"),
                                     config=zero_config(3, global_batch=8))
    p = engine.module.blocks[0].fc1.weight
    assert owner_of(p) is engine.zero and hasattr(p, "ds_id")
    state = weakref.ref(engine.zero)
    del engine
    gc.collect()
    return state() is None, owner_of(p) is None, hasattr(p, "ds_id")


def test_the_owner_registry_holds_nothing_alive(tmp_path):
    """A parameter kept after its engine is dropped holds no state: the registry is weak."""
    assert run_distributed(_dropped_engine_frees, 1, tmp_path) == [(True, True, False)]


def _gathered_keywords(rank, world_size):
    engine, *_ = meshzero.initialize(model=build_model("mlp"),
                                     config=zero_config(3, global_batch=8))
    fc1 = engine.module.blocks[0].fc1
    # enabled=False (as code writes ``enabled=zero_stage == 3``): no gathered block, and
    # a read inside still sees the full values (gathered on use)
    with deepspeed.zero.GatheredParameters([fc1.weight], enabled=False):
        read = fc1.weight.data.clone()
    # fwd_module (DeepSpeed registers the params as its external parameters meanwhile):
    # the modifier's write reaches every rank as without it
    with deepspeed.zero.GatheredParameters([fc1.weight, fc1.bias], modifier_rank=0,
                                           fwd_module=engine.module.blocks[0]):
        if rank == 0:
            with torch.no_grad():
                fc1.bias.fill_(0.25)
    written = engine.full_state_dict()
    engine.close()
    return read, written


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gathered_parameters_enabled_and_fwd_module_on_sharded_params(tmp_path, world_size):
    """``GatheredParameters(params, modifier_rank, fwd_module, enabled)``
    (deepspeed/runtime/zero/partition_parameters.py): ``enabled=False`` makes the block a
    no-op, ``fwd_module`` registers the parameters as the module's external ones while
    gathered (nothing to do here: meshzero gathers wherever a parameter is used), and the
    modifier rank's write is broadcast on exit, on a stage-3 engine's parameters."""
    plain = build_model("mlp").state_dict()
    for read, written in run_distributed(_gathered_keywords, world_size, tmp_path):
        torch.testing.assert_close(read, plain["blocks.0.fc1.weight"])
        for name, want in plain.items():
            if name == "blocks.0.fc1.bias":
                want = torch.full_like(want, 0.25)
            torch.testing.assert_close(written[name], want, msg=name)

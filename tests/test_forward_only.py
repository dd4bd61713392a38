"""An engine without an optimizer (issue 33, item 5): the frozen reference, reward and EMA
models of RLHF, which TRL, OpenRLHF and DeepSpeed-Chat build with
``deepspeed.initialize(model=ref, config=cfg)`` and no optimizer.

What DeepSpeed does (read from its source, deepspeed 0.19.6):

* ``DeepSpeedEngine.__init__`` (runtime/engine.py): ``has_optimizer`` is false when neither
  ``optimizer`` nor the config's optimizer name is given; then ``_configure_optimizer`` and
  ``_configure_lr_scheduler`` are never called, and with ZeRO enabled
  ``_configure_zero_optimizer(optimizer=None)`` builds, at stage 3, a
  ``DeepSpeedZeRoOffload`` (runtime/zero/parameter_offload.py): the parameters are
  partitioned and gathered module by module in forward, with no fp32 partitions, gradient
  partitions or optimizer states. At stages 0-2 it wraps a ``DummyOptim`` that holds none.
* ``DeepSpeedEngine.get_lr`` / ``_get_optimizer_param`` return ``[]`` without an optimizer.
* ``DeepSpeedEngine.offload_states`` asserts "Moving states across devices is not supported
  without an optimizer"; meshzero lets such an engine move its parameters to host memory
  between phases (tests/test_offload_states.py).

meshzero: ``engine.optimizer is None``; forward runs unit by unit at stage 3, under
``torch.no_grad()`` (nothing can step, so no graph is kept), and ``backward`` / ``step``
raise one line naming the fix. ``memory_report()`` shows parameters only, and the estimator
(``trainable="none"``, ``meshzero estimate --trainable none``) agrees with it to the byte.
"""

from __future__ import annotations

import copy

import pytest
import torch

import meshzero
from meshzero.estimate import Estimator, load_model, settings_from_config
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import TrickyModel, build_model

NO_OPT = ("this engine has no optimizer (forward only): pass optimizer= or a config "
          "'optimizer' block to train")

# (stage, precision, offload): "cpu" puts offload_param and offload_optimizer on cpu (the
# optimizer's is unused without an optimizer)
CASES = [(0, "fp32", "none"), (1, "fp32", "none"), (2, "fp32", "none"), (3, "fp32", "none"),
         (3, "bf16", "none"), (3, "fp32", "cpu")]


def _config(world: int, stage: int, precision: str, offload: str) -> dict:
    """DeepSpeed-Chat's get_eval_ds_config shape: no optimizer, no scheduler."""
    cfg: dict = {"train_batch_size": 2 * world,
                 "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload != "none":
        cfg["zero_optimization"].update(offload_param={"device": offload},
                                        offload_optimizer={"device": offload})
    return cfg


def _forward_only(rank: int, world: int, cases: list) -> list:
    out, engines = [], []
    for stage, precision, offload in cases:
        model = build_model("tricky", seed=1)
        plain = copy.deepcopy(model)  # the plain-torch reference
        engine, optimizer, _, scheduler = meshzero.initialize(
            model=model, config=_config(world, stage, precision, offload))
        assert optimizer is None and scheduler is None and engine.optimizer is None
        assert engine.get_lr() == []
        tokens = torch.randint(0, 29, (2, 5), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            got_no_grad = engine(tokens)
        got = engine(tokens)  # grad mode: no graph, no gradients, nothing left gathered
        again = engine(tokens)
        assert not got.requires_grad
        assert all(p.grad is None for p in model.parameters())
        if engine.zero.sharder is not None:
            assert not any(engine.zero.sharder.gathered)
        errors = []
        loss = plain(tokens).sum()
        for call, args in ((engine.backward, (loss,)), (engine.step, ())):
            with pytest.raises(ValueError) as info:
                call(*args)
            errors.append(str(info.value))
        want = plain(tokens).detach()
        out.append({"diff": max((t.float() - want).abs().max().item()
                                for t in (got, got_no_grad, again)),
                    "memory": engine.memory_report(), "errors": errors})
        engines.append(engine)
    # closed together at the end: closing an engine drops its gloo groups, and a group freed
    # on one rank while a peer still holds it raced the next engine's group creation at
    # W = 4 here ("Gloo connectFullMesh failed ... Connection closed by peer", 2 runs in 6)
    for engine in engines:
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forward_only_equals_plain_torch_and_holds_parameters_only(tmp_path, world_size):
    """Outputs equal plain torch's at stages 0-3 (W = 1, 2, 4); memory_report() has no
    master, gradient or optimizer-state bytes, and the estimator's ``trainable="none"``
    gives the same report, to the byte, on every rank."""
    cases = CASES if world_size == 2 else CASES[:4]  # bf16 and offload at W = 2
    results = run_distributed(_forward_only, world_size, tmp_path, cases, timeout=240)
    estimator = Estimator(load_model(TrickyModel))
    for i, (stage, precision, offload) in enumerate(cases):
        settings = settings_from_config(_config(world_size, stage, precision, offload),
                                        world_size, trainable="none")
        states = estimator.states(settings, world_size)
        for rank in range(world_size):
            got = results[rank][i]
            tol = 0.05 if precision == "bf16" else 1e-6
            assert got["diff"] <= tol, (stage, precision, rank, got["diff"])
            assert got["errors"] == [NO_OPT, NO_OPT]
            memory = got["memory"]
            for category in ("master_params", "grads", "optimizer_states"):
                assert sum(memory[category].values()) == 0, (category, memory)
            tier = "host" if offload == "cpu" and stage == 3 else "device"
            assert memory["params"][tier] > 0
            want = states.report(rank)
            assert want == {k: memory[k] for k in want}, (stage, precision, offload, rank)


def _load_trained(rank: int, world: int, path: str) -> float:
    """A trained checkpoint (AdamW, stage 2) and its 16-bit weights loaded into a
    forward-only stage-3 engine (an RLHF reference model from the SFT run)."""
    trained, *_ = meshzero.initialize(model=build_model("mlp"),
                                      config=zero_config(2, global_batch=2 * world))
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
    trained.backward(trained(x).pow(2).mean())
    trained.step()
    trained.save_checkpoint(path, tag="sft")
    trained.save_16bit_model(path)
    with torch.no_grad():
        want = trained(x)
    diffs = []
    for how in ("checkpoint", "weights"):
        ref, *_ = meshzero.initialize(model=build_model("mlp", seed=5),
                                      config=_config(world, 3, "fp32", "none"))
        if how == "checkpoint":
            ref.load_checkpoint(path, tag="sft")
        else:
            ref.load_weights(f"{path}/model.safetensors")
        diffs.append((ref(x) - want).abs().max().item())
        ref.save_checkpoint(f"{path}/ref", tag=how)  # saves its model, no optimizer
        ref.load_checkpoint(f"{path}/ref", tag=how)
        assert ref.full_state_dict().keys() == trained.full_state_dict().keys()
        ref.close()
    trained.close()
    return max(diffs)


def test_forward_only_loads_and_saves_checkpoints(tmp_path):
    """DeepSpeed's ``load_checkpoint`` on an engine built without an optimizer loads the
    module (``DeepSpeedEngine._load_checkpoint``: ``load_optimizer_states`` has nothing to
    go into); meshzero loads the model of any checkpoint, and saves one without optimizer
    state."""
    diffs = run_distributed(_load_trained, 2, tmp_path, str(tmp_path / "ckpt"), timeout=240)
    assert max(diffs) <= 1e-6


def _constant_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)


def _bad(rank: int, world: int, extra: dict, kwargs: dict) -> str:
    config = {"train_batch_size": world, **extra}
    try:
        meshzero.initialize(model=build_model("mlp"), config=config, **kwargs)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("extra, kwargs, message", [
    ({}, {"lr_scheduler": _constant_lr},
     "lr_scheduler is given but there is no optimizer for it to drive"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/tmp"},
                            "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}, {},
     "offload_param.device = 'nvme' needs an optimizer"),
])
def test_forward_only_refuses_what_needs_an_optimizer(tmp_path, extra, kwargs, message):
    assert message in run_distributed(_bad, 1, tmp_path, extra, kwargs)[0]


def test_estimate_forward_only_counts_parameters_only():
    """``estimate(..., trainable="none")``: no master, gradient or optimizer-state bytes (an
    offload_optimizer section is unused, as the engine leaves it), and the report says so."""
    from meshzero.estimate import Cluster, estimate

    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    est = estimate(TrickyModel, config=config, cluster=Cluster(gpus_per_node=2),
                   trainable="none", seq_len=5)
    states = est.model_states
    assert all(sum(states[c].values()) == 0
               for c in ("master_params", "grads", "optimizer_states", "offload_buffers"))
    assert states["params"]["device"] > 0 and est.unfrozen_states is None
    assert "no optimizer (forward only" in str(est)


def test_plan_refuses_forward_only():
    from meshzero.estimate.plan import plan

    with pytest.raises(ValueError, match="a plan ranks training configurations"):
        plan(TrickyModel, trainable="none", seq_len=5)

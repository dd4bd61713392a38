"""``meshzero.deepspeed.initialize`` and ``DeepSpeedEngine``: DeepSpeed's engine names as
real training code calls them, each held to what DeepSpeed's source does (the function is
cited in each test) and, for training, to one plain-torch process on the same global batch.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshzero
from meshzero.deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from meshzero.deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from meshzero.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import MLPStack, make_batches, mlp_loss, reference_train, split_for_rank

STEPS, GAS, CLIP = 3, 2, 10.0  # CLIP: large, so only the norm is computed (DeepSpeed's too)


def _core_has(name: str) -> bool:
    """The core name a DeepSpeed name maps onto (a missing one fails the test)."""
    assert hasattr(meshzero.Engine, name), f"meshzero.Engine has no {name}"
    return True


def _core_takes(method: str, keyword: str) -> bool:
    """The core keyword a DeepSpeed keyword maps onto (a missing one fails the test)."""
    params = inspect.signature(getattr(meshzero.Engine, method)).parameters
    assert keyword in params, f"meshzero.Engine.{method} takes no {keyword}"
    return True


class GenerativeMLP(MLPStack):
    """An MLPStack with what a Hugging Face model adds: the engine passes these through."""

    config_class = "MLPConfig"

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


def _model() -> GenerativeMLP:
    torch.manual_seed(0)
    return GenerativeMLP()


def _config(stage: int, **extra) -> dict:
    return zero_config(stage, global_batch=8, grad_accum=GAS, gradient_clipping=CLIP, **extra)


def _plain_mlp() -> MLPStack:
    torch.manual_seed(0)
    return MLPStack()


def _reference():
    batches = make_batches("mlp", STEPS, 8)
    return reference_train(_plain_mlp, batches, grad_accum=GAS, clip=CLIP, eps=ADAM_EPS)


# -- the DeepSpeed training loop -----------------------------------------------------------------
def _deepspeed_loop(rank, world_size, stage):
    import meshzero.deepspeed as deepspeed

    model = _model()
    engine, opt, loader, sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage))
    seen = {}
    for batch in make_batches("mlp", STEPS, engine.train_batch_size()):
        for micro in range(GAS):
            x, y = split_for_rank(batch, rank, world_size, GAS, micro)
            loss = mlp_loss(engine(x), y)
            seen["returned"] = (engine.backward(loss).item(), loss.item() / GAS)
            engine.allreduce_gradients()  # Megatron's call: backward has reduced already
            engine.step()
    seen.update(
        engine_type=type(engine).__name__, loader=loader, sched=sched,
        opt_is_adamw=isinstance(opt, torch.optim.AdamW), same_opt=opt is engine.optimizer,
        opt_classes=(isinstance(opt, DeepSpeedOptimizer), isinstance(opt, BF16_Optimizer)),
        overflow=opt.overflow, cur_scale=opt.cur_scale, lr=engine.get_lr(),
        mom=engine.get_mom(), norm=engine.get_global_grad_norm(),
        stage=engine.zero_optimization_stage(), zero=engine.zero_optimization(),
        partitions=(engine.zero_optimization_partition_gradients(),
                    engine.zero_optimization_partition_weights()),
        ranks=(engine.global_rank, engine.world_size, engine.local_rank, engine.dp_world_size,
               engine.mp_world_size, engine.get_data_parallel_rank(),
               engine.get_model_parallel_rank()),
        precision=(engine.fp16_enabled(), engine.bfloat16_enabled()),
        steps_per_print=engine.steps_per_print(), batch_info=engine.get_batch_info(),
        samples=engine.global_samples, clip=engine.gradient_clipping(),
        boundary=engine.is_gradient_accumulation_boundary(),
        passthrough=(engine.config_class, engine.blocks is model.blocks,
                     engine.generate(torch.zeros(1, 7)).shape),
        gather16=engine.zero_gather_16bit_weights_on_model_save(),
        optimizer_name=engine.optimizer_name(),
        dp_group_size=dist.get_world_size(engine.get_data_parallel_group()))
    with pytest.raises(AttributeError, match="GenerativeMLP have no attribute 'no_such'"):
        engine.no_such  # noqa: B018
    params = engine.full_state_dict()
    engine.destroy()
    return params, seen


@pytest.mark.parametrize(("stage", "world_size"), [(0, 2), (1, 2), (2, 2), (3, 2), (3, 1),
                                                   (3, 4)])
def test_deepspeed_loop_trains_like_torch(tmp_path, stage, world_size):
    """DeepSpeed's loop (docs/code-docs/source/training.rst: engine(x), engine.backward(loss),
    engine.step()) through ``import meshzero.deepspeed as deepspeed`` trains as plain torch,
    and the engine's queries answer as DeepSpeed's ``runtime/engine.py`` does:
    ``backward`` returns loss / gas (``backward``: gas_scaled_loss), ``get_lr``/``get_mom``
    list each group's lr / betas (``_get_optimizer_param``), ``zero_optimization*`` from the
    stage, ``get_global_grad_norm`` the last step's pre-clip norm, ``__getattr__`` falls
    through to the module, ``get_batch_info``, ``global_samples``, ``optimizer_name`` (the
    config's type lower-cased: runtime/config.py), ``allreduce_gradients`` after a boundary
    backward changes nothing (DeepSpeed's reduces only at the boundary, once)."""
    ref = _reference()
    for rank, (params, seen) in enumerate(run_distributed(_deepspeed_loop, world_size, tmp_path,
                                                          stage)):
        for name, p in ref.params.items():
            torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=name)
        got, want = seen["returned"]
        assert got == pytest.approx(want)
        assert seen["engine_type"] == "DeepSpeedEngine"
        assert seen["loader"] is None and seen["sched"] is None
        assert seen["opt_is_adamw"] and seen["same_opt"] and seen["opt_classes"] == (True, False)
        assert (seen["overflow"], seen["cur_scale"]) == (False, 1.0)
        assert seen["lr"] == [1e-2] and seen["mom"] == [(0.9, 0.999)]
        assert seen["norm"] == pytest.approx(ref.grad_norms[-1], rel=1e-5)
        assert (seen["stage"], seen["zero"]) == (stage, stage > 0)
        assert seen["partitions"] == (stage >= 2, stage == 3)
        assert seen["ranks"] == (rank, world_size, rank, world_size, 1, rank, 0)
        assert seen["precision"] == (False, False)
        assert seen["steps_per_print"] == 10 and seen["clip"] == CLIP
        assert seen["batch_info"] == (8, 8 // (GAS * world_size), GAS)
        assert seen["samples"] == 8 * STEPS
        assert seen["boundary"] is False  # the next micro-step opens a new window
        assert seen["passthrough"] == ("MLPConfig", True, torch.Size([1]))
        assert seen["gather16"] is True  # not given: meshzero's save_16bit_model saves
        assert seen["optimizer_name"] == "adamw" and seen["dp_group_size"] == world_size


# -- accumulation the caller drives --------------------------------------------------------------
def _manual_accumulation(rank, world_size, modes):
    import meshzero.deepspeed as deepspeed

    out, engines = {}, []  # destroyed at the end (a rebuild after close: see the report)
    for mode in modes:
        engine, *_ = deepspeed.initialize(model=_model(), config=_config(2))
        engines.append(engine)
        returned = []
        for batch in make_batches("mlp", STEPS, 8):
            for micro in range(GAS):
                x, y = split_for_rank(batch, rank, world_size, GAS, micro)
                loss = mlp_loss(engine(x), y)
                if mode == "boundary":  # DeepSpeed's docstring example: one step() per window
                    engine.set_gradient_accumulation_boundary(micro == GAS - 1)
                    engine.backward(loss)
                else:  # the caller divides; engine.step() after every micro-batch
                    scaled = loss / GAS
                    returned.append(engine.backward(scaled, scale_wrt_gas=False) is scaled)
                    engine.step()
            if mode == "boundary":
                engine.step()
        out[mode] = (engine.full_state_dict(), engine.global_steps, returned)
    for engine in engines:
        engine.destroy()
    return out


def test_caller_driven_accumulation_trains_like_torch(tmp_path):
    """DeepSpeed's ``backward(scale_wrt_gas=False)`` (runtime/engine.py ``backward``: neither
    the gradients nor the returned loss divided by the accumulation steps) and
    ``set_gradient_accumulation_boundary`` (its docstring's loop: the boundary set before
    each backward, one ``step()`` per window; the core's, from dscore) train as plain torch
    with accumulation."""
    modes = ["no_gas_scaling"]
    if _core_has("set_gradient_accumulation_boundary"):
        modes.append("boundary")
    ref = _reference()
    for out in run_distributed(_manual_accumulation, 2, tmp_path, modes):
        assert sorted(out) == sorted(modes)
        for mode, (params, steps, returned) in out.items():
            assert steps == STEPS and all(returned), mode
            for name, p in ref.params.items():
                torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6,
                                           msg=f"{mode} {name}")


# -- fp16: the ZeRO optimizer's overflow and cur_scale -------------------------------------------
def _fp16_overflow(rank, world_size):
    import meshzero.deepspeed as deepspeed

    cfg = zero_config(2, global_batch=4, fp16={"enabled": True, "initial_scale_power": 8,
                                               "hysteresis": 1})
    engine, opt, _, _ = deepspeed.initialize(model=_model(), config=cfg)
    seen = []
    for step, (x, y) in enumerate(make_batches("mlp", 3, 4)):
        x, y = split_for_rank((x, y), rank, world_size, 1, 0)
        loss = mlp_loss(engine(x).float(), y)
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        seen.append((opt.overflow, opt.cur_scale, opt.loss_scale, engine.was_step_applied()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # a scheduler accepts it
    bf16 = zero_config(1, global_batch=4, bf16={"enabled": True})
    _, bf16_opt, _, _ = deepspeed.initialize(model=_model(), config=bf16)
    kinds = (isinstance(opt, torch.optim.AdamW), type(opt).__name__, sorted(opt.state_dict()),
             len(opt.param_groups), sched.get_last_lr(), engine.fp16_enabled(),
             isinstance(opt, BF16_Optimizer), isinstance(bf16_opt, BF16_Optimizer))
    engine.destroy()
    return seen, kinds


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp16_overflow_and_cur_scale_on_the_returned_optimizer(tmp_path, world_size):
    """DeepSpeed's ZeRO optimizer (runtime/zero/stage_1_and_2.py: ``step`` sets
    ``self.overflow`` and skips; ``cur_scale`` / ``loss_scale`` read the loss scaler; dynamic
    scaling halves the scale on an overflow with hysteresis 1) as attributes of the optimizer
    ``initialize`` returns, which stays a torch.optim.AdamW a scheduler can wrap; it is a
    ``BF16_Optimizer`` where DeepSpeed's would be (bf16 at stage 1: runtime/engine.py
    ``_do_optimizer_sanity_check``), else not."""
    for seen, kinds in run_distributed(_fp16_overflow, world_size, tmp_path):
        assert seen == [(False, 256.0, 256.0, True), (True, 128.0, 128.0, False),
                        (False, 128.0, 128.0, True)]
        assert kinds == (True, "AdamW", ["param_groups", "state"], 1, [1e-2], True, False, True)


# -- checkpoints: DeepSpeed's keyword order ------------------------------------------------------
def _checkpoints(rank, world_size, save_dir):
    import meshzero.deepspeed as deepspeed

    cfg = _config(3, zero_optimization={"stage3_gather_16bit_weights_on_model_save": True})
    engine, opt, _, _ = deepspeed.initialize(model=_model(), config=cfg)

    def train_one(batch):
        for micro in range(GAS):
            x, y = split_for_rank(batch, rank, world_size, GAS, micro)
            engine.backward(mlp_loss(engine(x), y))
            engine.step()

    batches = make_batches("mlp", 2, 8)
    train_one(batches[0])
    saved = engine.save_checkpoint(save_dir, "one", client_state={"epoch": 1})
    after_one = engine.full_state_dict()
    train_one(batches[1])
    # DeepSpeed's positional order: (load_dir, tag, load_module_strict, load_optimizer_states)
    path, client = engine.load_checkpoint(save_dir, "one", True, False)
    steps_kept = {int(s["step"]) for s in opt.state.values()}  # optimizer state not loaded
    restored = engine.full_state_dict()
    written = (engine.save_16bit_model(save_dir), engine.save_16bit_model(save_dir, "actor.pt"))
    keywords = None
    if _core_takes("load_checkpoint", "load_module_only"):  # the core's keywords (ckpt)
        engine.save_checkpoint(save_dir, "two", save_latest=False,
                               exclude_frozen_parameters=True)
        latest = (Path(save_dir) / "latest").read_text().strip()
        found, _ = engine.load_checkpoint(save_dir, "two", load_module_strict=False,
                                          load_module_only=True)
        keywords = (latest, found is not None,
                    engine.save_16bit_model(save_dir, "frozen_out.bin",
                                            exclude_frozen_parameters=True))
    engine.destroy()
    return (saved, path is not None, client, steps_kept, written,
            all(torch.equal(restored[k], v) for k, v in after_one.items()), keywords)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_checkpoint_methods_take_deepspeeds_arguments(tmp_path, world_size):
    """DeepSpeed's ``save_checkpoint`` (returns True), ``load_checkpoint`` (positional order
    load_dir, tag, load_module_strict, load_optimizer_states, ...; returns (path,
    client_state)) and ``save_16bit_model`` (default ``pytorch_model.bin``; True when saved),
    all in runtime/engine.py, with the keywords real code passes (save_latest,
    exclude_frozen_parameters, load_module_strict, load_module_only); meshzero writes
    safetensors for a pickle file name."""
    save_dir = str(tmp_path / "ckpt")
    for out in run_distributed(_checkpoints, world_size, tmp_path, save_dir):
        saved, found, client, steps_kept, written, restored, keywords = out
        assert saved is True and found and client == {"epoch": 1}
        assert keywords == ("one", True, True)  # save_latest=False kept 'one' latest
        assert steps_kept == {2} and restored
        assert written == (True, True)
    names = sorted(os.listdir(save_dir))
    assert "model.safetensors" in names and "actor.safetensors" in names
    assert not any(n.endswith((".bin", ".pt")) for n in names)


def _stage3_surface(rank, world_size):
    import meshzero.deepspeed as deepspeed

    cfg = _config(3, zero_optimization={"stage3_gather_16bit_weights_on_model_save": False})
    engine, opt, _, _ = deepspeed.initialize(model=_model(), config=cfg)
    offload = opt.parameter_offload  # TRL's remove_hooks / add_hooks around generation
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload._register_deepspeed_module(offload.module)
    out = {"saved_without_gather": (engine.save_16bit_model("unused"),
                                    engine.zero_gather_16bit_weights_on_model_save())}
    params = list(engine.module.parameters())
    with engine.gathered(params):  # grad mode on: the units stay gathered after the block
        pass
    held = [p.untyped_storage().size() > 0 for p in params]
    engine.empty_partition_cache()
    freed = all(p.untyped_storage().size() == 0 for p in params)
    with engine.gathered(params):
        pass
    opt._partition_all_parameters()  # Lightning's call before loading a checkpoint
    out["gathered_then_freed"] = (any(held), freed,
                                  all(p.untyped_storage().size() == 0 for p in params))
    with pytest.raises(ValueError, match="device='nvme'"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="eval_batch.. drives a pipeline"):
        engine.eval_batch(iter([]))
    if _core_has("consolidated_16bit_state_dict"):
        full, names = engine._zero3_consolidated_16bit_state_dict(), engine.full_state_dict()
        also = engine._consolidated_16bit_state_dict()
        out["consolidated"] = (sorted(full) == sorted(names) == sorted(also) if rank == 0
                               else full == also == {})
    if _core_has("offload_states"):
        before = engine.full_state_dict()
        engine.offload_states(include=[OffloadStateTypeEnum.optim_states,
                                       OffloadStateTypeEnum.hp_params],
                              device=OffloadDeviceEnum.cpu, pin_memory=False)
        engine.reload_states()
        after = engine.full_state_dict()
        out["offload_roundtrip"] = all(torch.equal(before[k], after[k]) for k in before)
    engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stage3_surface(tmp_path, world_size):
    """DeepSpeed's stage-3 engine methods (runtime/engine.py): ``save_16bit_model`` returns
    False without stage3_gather_16bit_weights_on_model_save; ``empty_partition_cache``
    releases every gathered parameter (stage3.py -> parameter_offload.py:
    partition_all_parameters); ``offload_states`` takes DeepSpeed's enums
    (runtime/zero/offload_config.py) and refuses a device other than the CPU;
    ``_zero3_consolidated_16bit_state_dict`` gives rank 0 the full dict, the others {};
    ``optimizer.parameter_offload`` takes TRL's hook removal and re-registration."""
    for out in run_distributed(_stage3_surface, world_size, tmp_path):
        assert out["saved_without_gather"] == (False, False)
        assert out["gathered_then_freed"] == (True, True, True)
        assert out["consolidated"] is True
        assert out["offload_roundtrip"] is True


# -- no_sync, set_train_batch_size ----------------------------------------------------------------
def _core_surface(rank, world_size):
    import meshzero.deepspeed as deepspeed

    out, engines = {}, []
    for stage in (1, 2):
        engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage))
        engines.append(engine)
        try:
            with engine.no_sync():
                x, y = split_for_rank(make_batches("mlp", 1, 8)[0], rank, world_size, GAS, 0)
                engine.backward(mlp_loss(engine(x), y))
            out[stage] = "ok"
        except Exception as exc:  # noqa: BLE001 (the core's own error type)
            out[stage] = str(exc)
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(1))
    engine.set_train_batch_size(16)
    out["batch"] = engine.get_batch_info()
    with pytest.raises(ValueError):
        engine.set_train_batch_size(6)
    for built in [*engines, engine]:
        built.destroy()
    return out


def test_no_sync_and_set_train_batch_size(tmp_path):
    """DeepSpeed's ``no_sync`` (runtime/engine.py: asserts the stage does not partition
    gradients, so stage 1 runs it and stage 2 refuses) and ``set_train_batch_size`` (the
    micro batch stays, the accumulation steps change; a size the micro batch x dp does not
    divide is a ValueError)."""
    for out in run_distributed(_core_surface, 2, tmp_path):
        assert out[1] == "ok"
        assert out[2] != "ok" and "2" in out[2]
        assert out["batch"] == (16, 2, 4)


# -- the pipeline engine's names -----------------------------------------------------------------
def _pipeline_eval(rank, world_size):
    from meshzero.deepspeed.engine import DeepSpeedEngine
    from meshzero.engine import initialize
    from tests.test_pipeline import _mlp_chain

    cfg = zero_config(1, global_batch=8, grad_accum=2, pipeline_parallel={"size": 2})
    micro = [split_for_rank(make_batches("mlp", 1, 8)[0], 0, 1, 2, m) for m in range(2)]
    engine, *_ = initialize(model=_mlp_chain(), config=cfg, loss_fn=mlp_loss,
                            example_inputs=micro[0][0], engine_class=DeepSpeedEngine)
    loss = engine.eval_batch(iter(micro))
    untouched = (engine.global_steps, engine.module.training,
                 all(p.grad is None for p in engine.module.parameters()))
    _, logits = engine.eval_batch(iter(micro), return_logits=True)
    logits = None if logits is None else logits.shape
    with pytest.raises(NotImplementedError, match="num_micro_batches=3"):
        engine.eval_batch(iter(micro), num_micro_batches=3)
    trained = engine.train_batch(iter(micro))  # the same weights: the same loss
    stages = (engine.is_pipe_parallel, engine.is_first_stage(), engine.is_last_stage())
    engine.destroy()
    return loss.item(), trained.item(), untouched, stages, logits


def test_eval_batch_runs_the_pipeline_forward_only(tmp_path):
    """DeepSpeed's ``PipelineEngine.eval_batch`` (runtime/pipe/engine.py: the inference
    schedule over the micro-batches under no_grad, the mean loss broadcast to every stage;
    no step; ``return_logits``: the last stage's outputs too) on meshzero's pipeline, and
    ``is_first_stage`` / ``is_last_stage``."""
    from tests.test_pipeline import _mlp_chain

    x, y = make_batches("mlp", 1, 8)[0]
    with torch.no_grad():
        want = mlp_loss(_mlp_chain()(x), y).item()
    for rank, (loss, trained, untouched, stages, logits) in enumerate(
            run_distributed(_pipeline_eval, 2, tmp_path)):
        assert loss == pytest.approx(want, rel=1e-6) and trained == pytest.approx(loss)
        assert logits == (torch.Size([8, 5]) if rank == 1 else None)  # the last stage's
        assert untouched == (0, True, True)
        assert stages == (True, rank == 0, rank == 1)


# -- initialize's keywords -----------------------------------------------------------------------
class FakeMPU:
    """Megatron's mpu, as DeepSpeed reads it (utils/groups.py)."""

    def __init__(self, tp: int, dp: int, pp: int = 1):
        self.tp, self.dp, self.pp = tp, dp, pp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "needs a ds_config"),
    ({"config": {"a": 1}, "config_params": {"b": 2}}, "config and config_params"),
    ({"config": {}, "args": argparse.Namespace(deepspeed_config="x.json")},
     "args.deepspeed_config='x.json'"),
    ({"args": argparse.Namespace(deepspeed_config="a", deepscale_config="b")},
     "deepscale_config"),
    ({"config": {}, "collate_fn": list}, "collate_fn"),
    ({"config": {}, "dist_init_required": False}, "dist_init_required=False"),
    ({"config": {}, "mpu": FakeMPU(tp=2, dp=1)}, "tensor_parallel.size = 2"),
    ({"config": {}, "mpu": FakeMPU(tp=1, dp=1, pp=2)}, "pipeline_parallel.size = 2"),
    ({"config": {}, "mpu": FakeMPU(tp=1, dp=3)}, "data-parallel size is 3"),
    ({"config": {}, "mpu": object()}, "get_tensor_model_parallel_world_size"),
    ({"config": {}, "mesh_param": (1,)}, "mesh_param"),
    ({"config": {}, "mesh_param": (3, 1)}, "world size 1"),
])  # fmt: skip
def test_initialize_refuses_bad_arguments_before_any_work(kwargs, message):
    """DeepSpeed's ``initialize`` (deepspeed/__init__.py) asserts one config source
    (config, else config_params, else args.deepspeed_config; both config and args is an
    error) and ``comm.init_distributed`` asserts a process group exists with
    dist_init_required=False; an mpu whose model is sliced, or whose data-parallel size is
    not the world's, cannot map onto meshzero. Each is one ValueError before any work."""
    if dist.is_initialized():
        pytest.skip("this process has a process group")
    import meshzero.deepspeed as deepspeed

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deepspeed.initialize(model=_model(), **kwargs)


def _initialize_keywords(rank, world_size, config_path):
    import meshzero.deepspeed as deepspeed

    args = argparse.Namespace(local_rank=-1, deepspeed_config=config_path)
    out = {}
    engine, *_ = deepspeed.initialize(args=args, model=_model(), dist_init_required=True,
                                      mpu=FakeMPU(tp=1, dp=world_size),
                                      mesh_param=(world_size, 1))
    out["args"] = (args.local_rank, engine.local_rank, engine.zero_optimization_stage())
    first = engine
    cfg = _config(1)
    del cfg["optimizer"]
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, config_params=cfg, dist_init_required=False,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out["config_params"] = (engine.zero_optimization_stage(), engine.optimizer_name(),
                            engine.get_mom())
    engine.destroy()
    first.destroy()
    return out


def test_initialize_keywords(tmp_path):
    """DeepSpeed's ``initialize``: ``args.deepspeed_config`` is the config; ``args.local_rank``
    is set to the engine's (runtime/engine.py ``_configure_with_arguments``); an mpu of
    tensor and pipeline size 1 over the whole world maps; ``mesh_param`` (dp, sp) covers the
    world; ``config_params`` is the config when ``config`` is None; dist_init_required=False
    with a group works; a client optimizer's class name is ``optimizer_name`` and ``get_mom``
    lists SGD's momentum (runtime/engine.py: optimizer_name, get_mom)."""
    path = tmp_path / "ds_config.json"
    path.write_text(__import__("json").dumps(_config(2)))
    for rank, out in enumerate(run_distributed(_initialize_keywords, 2, tmp_path, str(path))):
        assert out["args"] == (rank, rank, 2)
        assert out["config_params"] == (1, "SGD", [0])


def _training_data(rank, world_size):
    import meshzero.deepspeed as deepspeed

    data = torch.utils.data.TensorDataset(*make_batches("mlp", 1, 16)[0])
    engine, _, loader, _ = deepspeed.initialize(model=_model(), training_data=data,
                                                config=copy.deepcopy(_config(1)))
    out = (loader is not None, engine.training_dataloader is loader)
    engine.destroy()
    return out


def test_training_data_gives_the_engines_loader(tmp_path):
    """DeepSpeed's ``initialize`` returns ``engine.training_dataloader`` as its third value
    when ``training_data`` is given (deepspeed/__init__.py: return_items)."""
    for out in run_distributed(_training_data, 2, tmp_path):
        assert out == (True, True)


def test_runtime_engine_import_path():
    """``from deepspeed.runtime.engine import DeepSpeedEngine`` (DeepSpeed's module path) and
    the callable aliases it defines (runtime/engine.py)."""
    from meshzero.deepspeed.engine import DeepSpeedEngine, _safetensors_name
    from meshzero.deepspeed.runtime import engine as runtime_engine

    assert runtime_engine.DeepSpeedEngine is DeepSpeedEngine
    assert issubclass(DeepSpeedEngine, meshzero.Engine)
    assert runtime_engine.DeepSpeedOptimizerCallable is not None
    assert _safetensors_name("pytorch_model.bin") == "model.safetensors"
    assert _safetensors_name("sub/actor.pt") == "sub/actor.safetensors"
    assert _safetensors_name("model.safetensors") == "model.safetensors"

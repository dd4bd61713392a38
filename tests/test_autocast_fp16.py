"""``torch_autocast`` with ``dtype`` float16: fp32 parameters, master and gradients, the
forward under ``torch.autocast(float16)``, the loss scaled on torch's ``GradScaler``
schedule; equal, step by step and in the loss scale, to plain torch's AMP recipe
(``torch.autocast`` + ``torch.amp.GradScaler``) on one process, at every ZeRO stage.

What DeepSpeed computes there (DeepSpeed 0.19.6): ``DeepSpeedEngine.__init__``
(runtime/engine.py) makes ``torch_autocast_z0_gradscaler = torch.amp.GradScaler(...)`` at
stage 0 when the autocast dtype is float16, scales the loss with it in ``backward`` and steps
through ``GradScaler.step`` / ``update`` in ``_take_model_step``; ``DeepSpeedZeroOptimizer``
(runtime/zero/stage_1_and_2.py) and ``DeepSpeedZeroOptimizer_Stage3`` (stage3.py) make the
same ``GradScaler`` when ``get_autocast_dtype() == torch.float16``, scale the loss in
``ZeROOptimizer.scale_if_loss`` (runtime/base_optimizer.py) and step through it. A
``GradScaler`` starts at 2**16, halves on an inf/nan gradient and skips that step, and
doubles after 2000 clean steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshzero
from meshzero.config import ConfigError, load_config
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS
from tests.models import make_batches, split_for_rank
from tests.test_autocast_bf16 import LossInside

STEPS, BATCH, LR, WD = 5, 8, 1e-2, 0.01
OVERFLOW_STEP = 2  # rank 0's loss is inf there: the step is skipped and the scale halves


def reference(world_size: int, autocast: bool = True) -> tuple[dict, list[float]]:
    """One process as DDP with torch's AMP recipe: each rank's piece of the batch under
    autocast(float16), its loss scaled by the GradScaler and backward on its own (the
    float16 ops see the scaled gradient of one rank, as each rank's backward does), the
    gradients summed and divided by N (DDP's average); AdamW through ``scaler.step``. The
    parameters after training and the scale after every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a float16 matmul rounds by its blocking
    try:
        model = LossInside()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=ADAM_EPS,
                                foreach=False)
        scaler = torch.amp.GradScaler("cpu")
        scales = []
        for step, batch in enumerate(make_batches("mlp", STEPS, BATCH)):
            for rank in range(world_size):
                x, y = split_for_rank(batch, rank, world_size, 1, 0)
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    loss = model(x, y)
                if step == OVERFLOW_STEP and rank == 0:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            for p in model.parameters():
                p.grad /= world_size
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(float(scaler.get_scale()))
    finally:
        torch.set_num_threads(threads)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, scales


def _config(stage: int) -> dict:
    return {"train_batch_size": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                      "eps": ADAM_EPS}},
            "torch_autocast": {"enabled": True, "dtype": "torch.float16"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train_stages(rank: int, world_size: int) -> dict:
    out = {}
    for stage in range(4):
        engine, _, _, _ = meshzero.initialize(model=LossInside(), config=_config(stage))
        scales, applied = [], []
        for step, batch in enumerate(make_batches("mlp", STEPS, BATCH)):
            x, y = split_for_rank(batch, rank, world_size, 1, 0)
            loss = engine(x, y)
            assert loss.dtype == torch.float32  # mse_loss: on autocast's fp32 list
            if step == OVERFLOW_STEP and rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            applied.append(engine.step())
            scales.append(engine.loss_scale)
        params = {n: p.detach().clone() for n, p in engine.full_state_dict().items()}
        out[stage] = (params, scales, applied)
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_float16_autocast_equals_torch_amp(tmp_path, world_size):
    want, want_scales = reference(world_size)
    plain, _ = reference(world_size, autocast=False)
    assert max(float((plain[n] - w).abs().max()) for n, w in want.items()) > 1e-5, \
        "autocast changes nothing here: the test would mean nothing"
    # GradScaler skips a step exactly when it halves the scale (at 2**16 the float16
    # backward of one rank may overflow on its own: at W = 4 step 0 does)
    before = [2.0 ** 16, *want_scales[:-1]]
    want_applied = [after == b for after, b in zip(want_scales, before, strict=True)]
    assert not want_applied[OVERFLOW_STEP] and want_applied[-1]
    for per_rank in run_distributed(_train_stages, world_size, tmp_path, timeout=300):
        for stage, (params, scales, applied) in per_rank.items():
            assert scales == want_scales, stage
            assert applied == want_applied, stage
            for name, ref in want.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, s=stage: f"stage {s} {n}: {m}")


def test_float16_autocast_loads_and_refusals_name_the_keys():
    cfg = load_config(_config(2))
    assert cfg.torch_autocast.dtype == "float16" and cfg.scales_loss
    assert cfg.compute_dtype == torch.float32  # fp32 parameters under the autocast
    for extra, words in (({"fp16": {"enabled": True}}, "fp16.enabled are both true"),
                         ({"bf16": {"enabled": True}}, "dtype 'float16' with bf16.enabled")):
        with pytest.raises(ConfigError, match=words):
            load_config({**_config(2), **extra})
    with pytest.raises(ConfigError, match="torch_autocast.dtype"):
        load_config({**_config(2), "torch_autocast": {"enabled": True, "dtype": "fp32"}})


def test_loss_is_computed_in_float16_inside_the_region():
    """The matmuls run in float16 inside the engine's forward (a sanity check that the
    region is float16, not bf16)."""
    seen = []
    model = LossInside()
    model.net.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    engine, *_ = meshzero.initialize(model=model, config=_config(0))
    x, y = make_batches("mlp", 1, BATCH)[0]
    engine(x, y)
    engine.close()
    assert seen == [torch.float16]
    assert F.mse_loss(torch.zeros(1), torch.zeros(1)).dtype == torch.float32

"""torch.compile under ZeRO (issue 35): the ``compile`` section and ``engine.compile()``
compile each ZeRO unit's forward, with no graph break inside a unit and no recompile after the
first compiled step, measured with dynamo's counters; compiled training equals plain torch.

DeepSpeed behaviour copied: ``engine.compile(backend, compile_kwargs, schedule)`` and
``engine.is_compiled`` (deepspeed/runtime/engine.py, ``DeepSpeedEngine.compile`` and
``is_compiled``; a second call is a no-op), and the ``compile`` section's DeepCompile fields
(deepspeed/compile/config.py, ``CompileConfig``)."""

from __future__ import annotations

import pytest
import torch

from meshzero.config import ConfigError, load_config
from tests.compile_runs import (
    N_LAYER,
    assert_compiled_once,
    compiled_config,
    gpt_reference,
    train_compiled,
)
from tests.distributed import run_distributed
from tests.engine_runs import zero_config


def _assert_params(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert ref.keys() <= got.keys()  # got: full_state_dict, which lists tied names too
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


# -- the config section -------------------------------------------------------------------------
def _problems(section: dict, **extra) -> str:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, "compile": section, **extra})
    return str(err.value)


def test_compile_section_is_validated_before_any_work():
    cfg = load_config({"train_batch_size": 2, "compile": {
        "enabled": True, "backend": "aot_eager", "kwargs": {"fullgraph": True, "dynamic": False}}})
    assert cfg.compile.enabled and cfg.compile.backend == "aot_eager"
    assert "compile.backend = 'no_such' is not a torch.compile backend; valid: [" in \
        _problems({"backend": "no_such"})
    text = _problems({"kwargs": {"modee": "default", "backend": "eager", "mode": "fast"}})
    assert "'modee'" in text and "compile.backend" in text and "mode 'fast'" in text


def test_deepcompile_fields_are_refused_unless_at_deepspeed_defaults():
    """DeepSpeed's CompileConfig defaults are accepted; DeepCompile is refused by name."""
    load_config({"train_batch_size": 2, "compile": {"deepcompile": False, "double_buffer": True,
                                                    "free_activation": False, "passes": None}})
    text = _problems({"deepcompile": True, "offload_activation": True})
    assert "'compile.deepcompile' asks for a DeepSpeed feature" in text
    assert "'compile.offload_activation'" in text and "a DeepCompile option" in text
    assert "engine.compile()" in text
    assert "compile.enabled and compile.disable are both true" in _problems(
        {"enabled": True, "disable": True})


def test_axolotl_disable_spelling_and_combinations():
    """axolotl writes {"disable": false, "backend": "inductor"}: accepted (compile stays
    off, as DeepSpeed leaves it); tp / sp / pp with compile are refused naming both keys."""
    cfg = load_config({"train_batch_size": 2, "compile": {"disable": False,
                                                          "backend": "inductor"}})
    assert not cfg.compile.enabled
    text = _problems({"enabled": True}, tensor_parallel={"size": 2, "plan": "gpt"})
    assert "compile.enabled with tensor_parallel.size = 2 is not supported yet" in text


# -- equivalence and counts ---------------------------------------------------------------------
def test_compiled_units_equal_plain_torch_with_accumulation_and_clipping(tmp_path):
    """W = 2, gradient accumulation 2 and clipping: stages 0 and 3 compiled by the config
    section, stage 2 by ``engine.compile(backend=, compile_kwargs=)`` (accelerate's call),
    which first refuses an unknown backend, a bad kwargs key, DeepCompile's schedule and
    compiled autograd before compiling anything. Each equals plain torch's parameters to
    1e-5, with 0 graph breaks, one frame for the 3 blocks and nothing compiled after the first
    compiled step (stage 3's first step runs eager: it records the gather order)."""
    gb, gas, clip = 8, 2, 0.05
    call = {"backend": "aot_eager", "compile_kwargs": {"fullgraph": True}}
    configs = [{**compiled_config(0, global_batch=gb, grad_accum=gas, gradient_clipping=clip),
                "_probe": True},
               {**zero_config(2, global_batch=gb, grad_accum=gas, gradient_clipping=clip),
                "_call": call},
               compiled_config(3, global_batch=gb, grad_accum=gas, gradient_clipping=clip)]
    results = run_distributed(train_compiled, 2, tmp_path, configs, timeout=300)
    ref = gpt_reference(gb, grad_accum=gas, clip=clip)
    for rank_runs in results:
        for stage, run in zip((0, 2, 3), rank_runs, strict=True):
            assert run["compiled"]
            _assert_params(run["params"], ref.params)
            assert_compiled_once(run["reports"], N_LAYER, first_step=1 if stage == 3 else 0)
        errors = rank_runs[1]["refusals"]
        assert len(errors) == 4
        assert "backend 'no_such' is not a torch.compile backend" in errors[0]
        assert "'fullgrap'" in errors[1] and "schedule is DeepCompile's" in errors[2]
        assert "compiled_autograd_enabled" in errors[3]
        assert rank_runs[1]["reports"][-1]["kwargs"] == {"fullgraph": True}
        _assert_recompile_warned(rank_runs[0]["probe"])


def _assert_recompile_warned(probe: dict) -> None:
    """A step on shorter sequences after the first: dynamo recompiles the blocks' graph on a
    size guard; meshzero counts it and logs one WARNING naming the unit and dynamo's reason."""
    report = probe["report"]
    assert report["recompiles"] == 1 and report["per_unit"]["blocks.0"]["recompiles"] == 1
    assert len(probe["warnings"]) == 1, probe["warnings"]
    text = probe["warnings"][0]
    assert "unit 'blocks.0' after step" in text and "recompile" in text and "size" in text


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_stage_and_world_size_equals_plain_torch(tmp_path, world_size):
    gb = 8
    configs = [compiled_config(s, global_batch=gb, grad_accum=2, gradient_clipping=0.05)
               for s in range(4)]
    results = run_distributed(train_compiled, world_size, tmp_path, configs, timeout=600)
    ref = gpt_reference(gb, grad_accum=2, clip=0.05)
    for rank_runs in results:
        for stage, run in enumerate(rank_runs):
            _assert_params(run["params"], ref.params)
            assert_compiled_once(run["reports"], N_LAYER, first_step=1 if stage == 3 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_compiled_within_bf16_tolerance(tmp_path, stage):
    configs = [compiled_config(stage, global_batch=4, bf16={"enabled": True})]
    runs = run_distributed(train_compiled, 2, tmp_path, configs, timeout=300)
    ref = gpt_reference(4, dtype=torch.bfloat16)
    for rank_runs in runs:
        _assert_params(rank_runs[0]["params"], ref.params, rtol=2e-2, atol=2e-3)
        assert_compiled_once(rank_runs[0]["reports"], N_LAYER,
                             first_step=1 if stage == 3 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_torch_checkpointed_blocks_compile(tmp_path, stage):
    """torch.utils.checkpoint around each compiled block: recompute runs the compiled
    forward again inside backward, with no new frame."""
    configs = [compiled_config(stage, global_batch=4)]
    runs = run_distributed(train_compiled, 2, tmp_path, configs, checkpointed=True,
                           timeout=300)
    ref = gpt_reference(4)
    for rank_runs in runs:
        _assert_params(rank_runs[0]["params"], ref.params)
        assert_compiled_once(rank_runs[0]["reports"], N_LAYER,
                             first_step=1 if stage == 3 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_inductor_compiled_units_equal_plain_torch(tmp_path, stage):
    configs = [compiled_config(stage, global_batch=4, backend="inductor")]
    runs = run_distributed(train_compiled, 2, tmp_path, configs, timeout=600)
    ref = gpt_reference(4)
    for rank_runs in runs:  # inductor fuses: a few fp32 ulps of round-off
        _assert_params(rank_runs[0]["params"], ref.params, rtol=1e-4, atol=1e-5)
        assert_compiled_once(rank_runs[0]["reports"], N_LAYER,
                             first_step=1 if stage == 3 else 0)


@pytest.mark.slow
def test_profiler_report_shows_the_compile_counts(tmp_path):
    """flops_profiler at step 1: the counting step 0 and the timed step 1 run the units eager
    (a dispatch mode and module marks); the report carries engine.compile_report()."""
    cfg = compiled_config(0, global_batch=4, flops_profiler={
        "enabled": True, "profile_step": 1, "headline_steps": 1})
    run = run_distributed(train_compiled, 1, tmp_path, [cfg], timeout=300)[0][0]
    _assert_params(run["params"], gpt_reference(4).params)
    assert_compiled_once(run["reports"], N_LAYER, first_step=2)
    assert [r["per_unit"]["blocks.0"]["compiled_calls"] for r in run["reports"]] == [0, 0, 1]
    compiled, text = run["profile"]
    assert compiled["units"] == N_LAYER and compiled["graph_breaks"] == 0
    assert "compiled units" in text and "0 graph breaks" in text


@pytest.mark.slow
def test_offloaded_params_and_optimizer_compile(tmp_path):
    """Stage 3 with parameters and optimizer states offloaded to host memory: the gathers
    read host shards, eager, around the same compiled forwards."""
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    cfg = compiled_config(3, global_batch=4, zero_optimization=offload)
    runs = run_distributed(train_compiled, 2, tmp_path, [cfg], timeout=300)
    ref = gpt_reference(4)
    for rank_runs in runs:
        _assert_params(rank_runs[0]["params"], ref.params)
        assert_compiled_once(rank_runs[0]["reports"], N_LAYER, first_step=1)

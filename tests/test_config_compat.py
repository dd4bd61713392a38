"""The acceptance policy for DeepSpeed's keys (config_compat): aliases and older spellings are
renamed (deprecations said), hints that cannot change results are accepted and listed for one
INFO line, values that ask for nothing are accepted, "auto" is resolved where Hugging Face's
integration would resolve it, and everything else that cannot be honoured is refused in one
read."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import meshzero
from meshzero.config import ConfigError, load_config

DS_STYLE = {
    "train_batch_size": 4,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "prescale_gradients": False,
    "bfloat16": {"enabled": True},
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
    "tensorboard": {"enabled": False, "output_path": "x", "job_name": "y"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "_comment": "a JSON comment",
    "zero_optimization": {
        "stage": 3, "round_robin_gradients": True, "contiguous_gradients": False,
        "cpu_offload": True, "sub_group_size": 0, "max_live_parameters": 0,
        "max_reuse_distance": 7, "stage3_gather_fp16_weights_on_model_save": True,
        "zero_quantized_weights": False,
        "offload_param": {"device": "cpu", "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
}


def test_deepspeed_spellings_hints_and_noops_load() -> None:
    config = load_config(DS_STYLE)
    zc = config.zero_optimization
    assert config.bf16.enabled and config.data_types.grad_accum_dtype == "fp32"
    assert zc.offload_optimizer.device == "cpu"  # cpu_offload: true
    assert zc.offload_param.device == "cpu"
    assert (zc.stage3_max_live_parameters, zc.stage3_max_reuse_distance) == (0, 7)
    assert zc.stage3_gather_16bit_weights_on_model_save is True
    hints = " ".join(config.hints)
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                "round_robin_gradients", "contiguous_gradients", "sub_group_size = 0",
                "offload_param.buffer_size", "offload_param.max_in_cpu"):
        assert key in hints, key
    deprecated = " ".join(config.deprecations)
    assert "stage3_gather_fp16_weights_on_model_save" in deprecated
    assert "zero_optimization.cpu_offload" in deprecated


def test_two_spellings_with_different_values_are_refused() -> None:
    raw = {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True,
                                 "stage3_gather_16bit_weights_on_model_save": False}}
    with pytest.raises(ConfigError, match="same key in two spellings"):
        load_config(raw)


def test_prescale_and_predivide_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="give one"):
        load_config({"prescale_gradients": True, "gradient_predivide_factor": 2.0})


def test_typos_are_still_refused_with_the_nearest_key() -> None:
    with pytest.raises(ConfigError, match="did you mean 'zero_optimization.round_robin_grad"):
        load_config({"zero_optimization": {"round_robin_gradient": True}})
    with pytest.raises(ConfigError, match="did you mean 'zero_allow_untested_optimizer'"):
        load_config({"zero_allow_untested_optimiser": True})


def test_auto_resolved_from_the_model_and_the_other_batch_keys() -> None:
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    config = load_config(raw, model=model)
    zc = config.zero_optimization
    assert (zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size,
            zc.stage3_param_persistence_threshold) == (4096, 3686, 640)
    assert config.resolve_batch(2) == (8, 4, 1)
    alone = load_config(raw)  # without the model: meshzero's defaults, until initialize
    assert alone.zero_optimization.reduce_bucket_size == 500_000_000
    again = load_config(alone, model=model)
    assert again.zero_optimization == zc


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_hints_logged_once_at_initialize() -> None:
    raw = {"train_batch_size": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2, "round_robin_gradients": True},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    records, log = _Records(), logging.getLogger("meshzero")  # propagate is off: attach here
    log.addHandler(records)
    # setLevel, not `log.level =`: it also clears the loggers' isEnabledFor caches, which an
    # earlier test's INFO call at WARNING level would otherwise leave saying no
    level = log.level
    log.setLevel(logging.INFO)
    try:
        engine, *_ = meshzero.initialize(model=torch.nn.Linear(3, 2), config=raw)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    lines = [m for m in records.messages if "change nothing here" in m]
    assert len(lines) == 1
    assert "round_robin_gradients" in lines[0] and "zero_allow_untested" in lines[0]
    engine.close()


@pytest.mark.parametrize(("key", "value", "saved"), [
    ("stage3_gather_16bit_weights_on_model_save", False, False),
    ("stage3_gather_fp16_weights_on_model_save", True, True),
    ("gather_16bit_weights_on_model_save", False, False),
    (None, None, True),  # not given: meshzero saves
])  # fmt: skip
def test_16bit_save_key_honoured_at_stage_3(tmp_path, key, value, saved) -> None:
    zero: dict = {"stage": 3}
    if key is not None:
        zero[key] = value
    raw = {"train_batch_size": 2, "zero_optimization": zero,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = meshzero.initialize(model=torch.nn.Linear(3, 2), config=raw)
    out = engine.save_16bit_model(tmp_path)
    engine.close()
    assert (out is not None) == saved
    assert any(tmp_path.iterdir()) == saved


@pytest.mark.parametrize(("kind", "params", "cls"), [
    ("Adam", {"adam_w_mode": False, "torch_adam": True}, torch.optim.Adam),
    ("Adam", {"torch_adam": True, "bias_correction": True}, torch.optim.AdamW),
    ("AdamW", {"adam_w_mode": False, "torch_adam": True}, torch.optim.AdamW),
])  # fmt: skip
def test_adam_flags_pick_torch_classes_as_deepspeed(kind, params, cls) -> None:
    raw = {"train_batch_size": 2,
           "optimizer": {"type": kind, "params": {"lr": 1e-3, "weight_decay": 0.1, **params}}}
    engine, optimizer, *_ = meshzero.initialize(model=torch.nn.Linear(3, 2), config=raw)
    engine.close()
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["weight_decay"] == 0.1

"""meshzero.config: every mutation of a valid ds_config fails loudly with its dotted key."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from meshzero.config import Config, ConfigError, load_config

BASE: dict[str, Any] = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 100,
            "total_num_steps": 1000,
        },
    },
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "seed": 1234,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
    },
}

DELETE = object()
UNKNOWN = "unknown config key"
NOT_YET = "does not implement yet"
AUTO = "is 'auto'"

# (path to change, new value, fragments the message must contain; the first is the dotted key)
MUTATIONS: list[tuple[tuple[str, ...], Any, tuple[str, ...]]] = [
    # unknown keys at each level, with the nearest valid key when there is one
    (("train_batch_sizee",), 32, ("train_batch_sizee", "did you mean 'train_batch_size'")),
    (("zero_optimization", "stagee"), 2, ("zero_optimization.stagee", "'zero_optimization.stage'")),
    (("fp16", "enable"), True, ("fp16.enable", "did you mean 'fp16.enabled'")),
    (("bf16", "xyz"), True, ("bf16.xyz", UNKNOWN, "enabled")),
    (("optimizer", "typ"), "Adam", ("optimizer.typ", "did you mean 'optimizer.type'")),
    (("optimizer", "params", "lrr"), 0.1, ("optimizer.params.lrr", "'optimizer.params.lr'")),
    (("optimizer", "params", "momentum"), 0.9, ("optimizer.params.momentum", UNKNOWN)),
    (("scheduler", "params", "warmup_steps"), 5, ("scheduler.params.warmup_steps", UNKNOWN)),
    # wrong types
    (("zero_optimization", "stage"), "3", ("zero_optimization.stage", "'3'")),
    (("zero_optimization", "stage"), True, ("zero_optimization.stage", "boolean")),
    (("train_micro_batch_size_per_gpu",), 5.5, ("train_micro_batch_size_per_gpu", "5.5")),
    (("zero_optimization", "reduce_bucket_size"), 5.5e8 + 0.5, ("zero_optimization.reduce_b",)),
    (("optimizer", "params", "weight_decay"), "0.1", ("optimizer.params.weight_decay",)),
    (("wall_clock_breakdown",), "yes", ("wall_clock_breakdown", "'yes'")),
    (("zero_optimization", "unit_classes"), "Block", ("zero_optimization.unit_classes",)),
    (("zero_optimization",), 3, ("zero_optimization",)),
    (("communication_data_type",), "fp8", ("communication_data_type", "'fp8'")),
    (("optimizer", "type"), DELETE, ("optimizer.type", "missing")),
    # out of range
    (("zero_optimization", "stage"), 4, ("zero_optimization.stage", "4")),
    (("zero_optimization", "stage"), -1, ("zero_optimization.stage",)),
    (("zero_optimization", "reduce_bucket_size"), -1, ("zero_optimization.reduce_bucket_size",)),
    (("zero_optimization", "allgather_bucket_size"), -1, ("zero_optimization.allgather_bucket",)),
    (("zero_optimization", "stage3_prefetch_bucket_size"), -5, ("stage3_prefetch_bucket_size",)),
    (("gradient_clipping",), -1.0, ("gradient_clipping",)),
    (("steps_per_print",), 0, ("steps_per_print",)),
    (("seed",), -1, ("seed",)),
    (("fp16", "initial_scale_power"), 65, ("fp16.initial_scale_power",)),
    (("fp16", "loss_scale_window"), 0, ("fp16.loss_scale_window",)),
    (("optimizer", "params", "betas"), [0.9, 1.0], ("optimizer.params.betas",)),
    (("optimizer", "params", "lr"), -1e-3, ("optimizer.params.lr",)),
    (("scheduler", "params", "total_num_steps"), 50, ("scheduler.params.total_num_steps", "100")),
    (("scheduler", "params", "warmup_type"), "cosine", ("scheduler.params.warmup_type",)),
    # cross-key rules
    (("train_batch_size",), 30, ("train_batch_size (30)", "(4)", "(2)")),
    (("fp16", "enabled"), True, ("fp16.enabled", "bf16.enabled")),
    # features meshzero keeps always on: false is a hint (accepted), nonsense is not
    (("zero_optimization", "contiguous_gradients"), "no", ("zero_optimization.contiguous_grad",)),
    (("zero_optimization", "reduce_scatter"), 0, ("zero_optimization.reduce_scatter",)),
    (("zero_optimization", "allgather_partitions"), [], ("zero_optimization.allgather_par",)),
    # optimizer and scheduler types
    (
        ("optimizer", "type"),
        "MuAdam",
        ("optimizer.type", "'MuAdam' is a DeepSpeed optimizer", "valid: Adam, AdamW, SGD"),
    ),
    (("optimizer", "type"), "RMSprop", ("optimizer.type", "valid: Adam, AdamW, SGD, Lamb")),
    (("scheduler", "type"), "OneCycle", ("scheduler.type", "WarmupCosineLR")),
    # "auto" where neither Hugging Face nor Accelerate fill it, at several depths
    (("seed",), "auto", ("'seed'", AUTO)),
    (("zero_optimization", "allgather_bucket_size"), "auto", ("zero_optimization.allgather_b",
                                                             AUTO)),
    (("scheduler", "params", "total_num_steps"), "auto", ("scheduler.params.total_num", AUTO)),
    (("optimizer", "params", "betas"), [0.9, "auto"], ("optimizer.params.betas[1]", AUTO)),
    # DeepSpeed features that change results and that meshzero does not implement yet
    (("zero_optimization", "cpu_offload"), "yes", ("zero_optimization.cpu_offload", "true or")),
    (("zero_optimization", "zero_quantized_gradients"), "yes",
     ("zero_optimization.zero_quantized_gradients", "valid boolean")),
    # offload: validated keys
    (
        ("zero_optimization", "offload_param"),
        {"device": "nvme", "nvme_path": "/nvme"},
        ("zero_optimization.offload_param.device = 'nvme' needs zero_optimization.offload_opt",),
    ),
    (
        ("zero_optimization", "offload_optimizer"),
        {"device": "nvme"},
        ("offload_optimizer.device = 'nvme' needs zero_optimization.offload_optimizer.nvme_path",),
    ),
    (("zero_optimization", "offload_optimizer"), {"device": "gpu"},
     ("zero_optimization.offload_optimizer.device = 'gpu'", "'none', 'cpu' or 'nvme'")),
    (("zero_optimization", "sub_group_size"), -1, ("zero_optimization.sub_group_size = -1",)),
    (("zero_optimization", "zero_quantized_weights"), "yes", ("zero_quantized_weights",
                                                               "valid boolean")),
    (("zero_optimization", "zeropp_loco_param"), {"err_beta": 0.8},
     ("zero_optimization.zeropp_loco_param", NOT_YET)),
    (("zero_optimization", "zero_hpz_partition_size"), 0,
     ("zero_optimization.zero_hpz_partition_size = 0",)),
    (("wandb",), {"enabled": True, "projectt": "x"}, ("wandb.projectt", "'wandb.project'")),
    (("amp",), {"enabled": True}, ("'amp'", NOT_YET)),
    (("tensorboard",), {"enabled": True, "job": "x"}, ("tensorboard.job", UNKNOWN)),
    (("gradient_predivide_factor",), 0, ("gradient_predivide_factor = 0",)),
    (("prescale_gradients",), "yes", ("prescale_gradients = 'yes'",)),
    (("fp16", "auto_cast"), "yes", ("fp16.auto_cast",)),
    (("fp16", "fp16_master_weights_and_grads"), True,
     ("'fp16.fp16_master_weights_and_grads'", NOT_YET)),
    (("data_types",), {"grad_accum_dtype": "fp8"}, ("data_types.grad_accum_dtype", "'fp8'")),
    (("data_types",), {"grad_accum_dtype": "fp16"}, ("data_types.grad_accum_dtype",
                                                     "fp16.enabled")),
    (("optimizer", "params", "bias_correction"), "no",
     ("optimizer.params.bias_correction = 'no'",)),
    (("zero_optimization", "max_live_parameters"), "many",
     ("zero_optimization.stage3_max_live_parameters = 'many'",)),
]


def mutated(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    node = config
    for part in path[:-1]:
        node = node[part]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


def test_base_config_is_valid() -> None:
    config = load_config(BASE)
    assert config.zero_optimization.stage == 3
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(config.zero_optimization.reduce_bucket_size, int)


@pytest.mark.parametrize(
    ("path", "value", "fragments"), MUTATIONS, ids=[".".join(m[0]) for m in MUTATIONS]
)
def test_invalid_config_names_the_key(
    path: tuple[str, ...], value: Any, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as info:
        load_config(mutated(path, value))
    assert isinstance(info.value, ConfigError)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_every_problem_is_reported_one_per_line() -> None:
    config = mutated(("zero_optimization", "stage"), 4)
    config["seed"] = -3
    config["amp"] = {"enabled": True}
    config["train_batch_size"] = "auto"  # resolved: the batch keys come from each other
    config["optimizer"]["params"]["lr"] = "auto"  # resolved: TrainingArguments' default
    config["zero_optimization"]["allgather_bucket_size"] = "auto"  # nobody fills it: listed
    with pytest.raises(ConfigError) as info:
        load_config(config)
    lines = str(info.value).splitlines()
    assert "4 problems" in lines[0]
    assert any("zero_optimization.stage = 4" in line for line in lines[1:])
    assert any("seed = -3" in line for line in lines[1:])
    assert any("'amp'" in line and NOT_YET in line for line in lines[1:])
    assert any("'zero_optimization.allgather_bucket_size'" in line and AUTO in line
               for line in lines[1:])


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match="valid keys at 'zero_optimization': stage, overlap_comm"):
        load_config({"zero_optimization": {"qqqqqqqq": 1}})


REALISTIC_DS_CONFIG = """
{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 4,
  "steps_per_print": 2000,
  "gradient_clipping": 1.0,
  "wall_clock_breakdown": false,
  "optimizer": {
    "type": "adam",
    "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 500}
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 2e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9
  }
}
"""


@pytest.mark.parametrize("as_path", [False, True])
def test_realistic_ds_config_loads_from_file(tmp_path: Path, as_path: bool) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(REALISTIC_DS_CONFIG)
    config = load_config(path if as_path else str(path))
    zero = config.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (3, 5e8, 2e8)
    assert type(zero.stage3_max_live_parameters) is int
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert config.optimizer is not None and config.optimizer.type == "Adam"
    params = config.optimizer.validated_params()
    assert params["lr"] == 2e-5 and params["adam_w_mode"] is True and params["amsgrad"] is False
    assert config.scheduler is not None and config.scheduler.type == "WarmupLR"
    assert config.scheduler.params == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 2e-5, "warmup_num_steps": 500, "warmup_type": "log"
    }  # fmt: skip
    assert config.compute_dtype == torch.float16
    assert config.resolve_batch(dp_size=4) == (32, 2, 4)


def test_defaults_are_filled() -> None:
    config = load_config({})
    assert config.optimizer is None and config.scheduler is None
    assert config.fp16.enabled is False and config.fp16.initial_scale_power == 16
    assert config.fp16.loss_scale_window == 1000 and config.fp16.hysteresis == 2
    assert config.zero_optimization.stage == 0
    assert config.zero_optimization.stage3_param_persistence_threshold == 100_000
    assert config.zero_optimization.unit_classes is None
    assert config.gradient_clipping == 0.0 and config.steps_per_print == 10
    assert config.communication_dtype is None
    assert config.resolve_batch(dp_size=2) == (2, 1, 1)


def test_existing_config_is_returned_as_is() -> None:
    config = load_config(BASE)
    assert load_config(config) is config


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("adam", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                  "amsgrad": False, "adam_w_mode": True, "torch_adam": False,
                  "bias_correction": True}),
        ("ADAMW", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                   "amsgrad": False, "adam_w_mode": True, "torch_adam": False,
                   "bias_correction": True}),
    ],
)  # fmt: skip
def test_optimizer_defaults(kind: str, expected: dict[str, Any]) -> None:
    optimizer = load_config({"optimizer": {"type": kind}}).optimizer
    assert optimizer is not None
    assert optimizer.validated_params() == expected


def test_sgd_needs_lr() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr is required"):
        load_config({"optimizer": {"type": "sgd", "params": {"momentum": 0.9}}})
    optimizer = load_config({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}}).optimizer
    assert optimizer is not None and optimizer.type == "SGD"
    assert optimizer.validated_params() == {
        "lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False
    }  # fmt: skip


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(path)


def test_invalid_json_gives_the_position(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "seed": ,\n}\n')
    with pytest.raises(ConfigError, match="line 3 column 11"):
        load_config(str(path))


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(path)
    with pytest.raises(ConfigError):
        load_config(42)  # type: ignore[arg-type]


def batch_config(tbs: int | None, micro: int | None, gas: int | None) -> Config:
    given = {
        "train_batch_size": tbs,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
    }
    return load_config({key: value for key, value in given.items() if value is not None})


@pytest.mark.parametrize(
    ("tbs", "micro", "gas", "dp_size", "expected"),
    [
        (32, 4, 2, 4, (32, 4, 2)),
        (32, 4, None, 2, (32, 4, 4)),
        (32, None, 2, 2, (32, 8, 2)),
        (None, 4, 2, 3, (24, 4, 2)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 4, None, 3, (12, 4, 1)),
        (None, None, None, 2, (2, 1, 1)),
    ],
)
def test_resolve_batch(
    tbs: int | None, micro: int | None, gas: int | None, dp_size: int,
    expected: tuple[int, int, int],
) -> None:  # fmt: skip
    assert batch_config(tbs, micro, gas).resolve_batch(dp_size) == expected


@pytest.mark.parametrize(
    ("tbs", "micro", "gas", "dp_size", "fragments"),
    [
        (48, 4, 3, 2, ("train_batch_size (48)", "train_micro_batch_size_per_gpu (4)",
                       "gradient_accumulation_steps (3)", "data-parallel size (2)", "= 24")),
        (24, 4, None, 4, ("train_batch_size (24)", "train_micro_batch_size_per_gpu (4)",
                          "gradient_accumulation_steps", "data-parallel size (4)")),
        (24, None, 3, 16, ("train_batch_size (24)", "gradient_accumulation_steps (3)",
                           "train_micro_batch_size_per_gpu", "data-parallel size (16)")),
        (10, None, None, 4, ("train_batch_size (10)", "gradient_accumulation_steps (1)",
                             "train_micro_batch_size_per_gpu", "data-parallel size (4)")),
    ],
)  # fmt: skip
def test_resolve_batch_mismatch(
    tbs: int | None, micro: int | None, gas: int | None, dp_size: int,
    fragments: tuple[str, ...],
) -> None:  # fmt: skip
    with pytest.raises(ConfigError) as info:
        batch_config(tbs, micro, gas).resolve_batch(dp_size)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_accumulation_alone_is_not_enough() -> None:
    with pytest.raises(ConfigError, match="gradient_accumulation_steps \\(4\\) alone"):
        load_config({"gradient_accumulation_steps": 4})


def test_resolve_batch_rejects_bad_dp_size() -> None:
    with pytest.raises(ValueError, match="data-parallel size"):
        load_config({}).resolve_batch(0)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [({}, torch.float32), ({"fp16": {"enabled": True}}, torch.float16),
     ({"bf16": {"enabled": True}}, torch.bfloat16)],
)  # fmt: skip
def test_compute_dtype(precision: dict[str, Any], dtype: torch.dtype) -> None:
    assert load_config(precision).compute_dtype == dtype


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_communication_dtype(name: str, dtype: torch.dtype) -> None:
    assert load_config({"communication_data_type": name}).communication_dtype == dtype


def test_dumped_config_loads_again() -> None:
    config = load_config(BASE)
    assert load_config(config.model_dump()) == config
    assert load_config(json.loads(config.model_dump_json())) == config

"""Keys outside the schema: unknown top-level keys (ignored with a warning unless misspelt),
DeepSpeed's retired keys, an ``aio`` block inside zero_optimization, max_grad_norm on Adam,
AutoTP without the model, and the DeepSpeed features that stay refused."""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.config import ConfigError, load_config
from meshzero.config.ignored import edit_distance

IGNORED = "ignored, as DeepSpeed ignores it"


def test_an_unknown_top_level_key_is_ignored_with_one_warning() -> None:
    config = load_config({"train_batch_size": 8, "cuda_visible_devices": "0,1",
                          "my_project": {"run": 3}})
    assert config.train_batch_size == 8
    assert [w.split(":")[0] for w in config.warnings] == ["cuda_visible_devices", "my_project"]
    assert all(IGNORED in w for w in config.warnings)


@pytest.mark.parametrize(("key", "meant"), [
    ("train_batch_sizes", "train_batch_size"),  # edit distance 1
    ("gradient_clippin", "gradient_clipping"),
    ("bf61", "bf16"),  # distance 2
    ("stage", "zero_optimization.stage"),  # a key of a section, at the top level
    ("offload_optimizer", "zero_optimization.offload_optimizer"),
    ("lr", "optimizer.params.lr"),
])  # fmt: skip
def test_a_near_miss_stays_an_error_naming_the_key_meant(key: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'; did you mean '{meant}'"):
        load_config({key: 1})


def test_keys_deepspeed_reads_are_never_ignored() -> None:
    """A top-level key DeepSpeed's parser reads is a hint, a no-op value or a refusal: the
    'ignored' warning is only for keys DeepSpeed ignores too."""
    config = load_config({"gradient_allreduce_op": "mean", "managed_gradient_accumulation": True,
                          "graph_harvesting": True, "log_level": "info",
                          "comet": {"enabled": False}})
    assert config.warnings == () and len(config.hints) == 2
    refused = {"gradient_allreduce_op": "sum", "managed_gradient_accumulation": False,
               "quantize_training": {"enabled": True}, "comet": {"enabled": True},
               "expert_parallel": {"enabled": True}}
    with pytest.raises(ConfigError) as info:
        load_config(refused)
    message = str(info.value)
    assert f"({len(refused)} problems)" in message
    for key in refused:
        assert f"'{key}'" in message


def test_every_misspelling_in_one_read_and_unknown_keys_inside_sections_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"stage": 3, "train_batch_sizee": 2, "zero_optimization": {"qqq": 1},
                     "cuda_visible_devices": "0"})
    message = str(info.value)
    assert "(3 problems)" in message
    for key in ("'stage'", "'train_batch_sizee'", "'zero_optimization.qqq'"):
        assert key in message
    assert "cuda_visible_devices" not in message


def test_edit_distance() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert edit_distance("bf16", "bf61") == 2
    assert edit_distance("same", "same") == 0


def test_retired_keys_load_as_no_ops_with_a_deprecation_line() -> None:
    config = load_config({"train_batch_size": 8, "disable_allgather": True,
                          "vocabulary_size": 50257})
    assert len(config.deprecations) == 2
    assert all("retired" in line for line in config.deprecations)
    assert load_config({"train_batch_size": 8}).model_dump() == config.model_dump()


def test_the_boolean_zero_spelling() -> None:
    config = load_config({"zero_optimization": True, "allgather_size": 2e8})
    assert config.zero_optimization.stage == 1
    assert config.zero_optimization.allgather_bucket_size == 200_000_000
    assert load_config({"zero_optimization": False}).zero_optimization.stage == 0
    assert "deprecated" in config.deprecations[0]


def test_aio_inside_zero_optimization_is_read_as_the_top_level_block() -> None:
    aio = {"block_size": 1048576, "queue_depth": 8}
    config = load_config({"zero_optimization": {"stage": 3, "aio": aio}})
    assert config.zero_optimization.stage == 3
    assert any("aio belongs at the top level" in w for w in config.warnings)
    assert any(h.startswith("aio ") for h in config.hints)  # then the top-level hint
    with pytest.raises(ConfigError, match="zero_optimization.aio and aio"):
        load_config({"aio": {"block_size": 4096}, "zero_optimization": {"aio": aio}})


def test_max_grad_norm_on_adam_warns_and_points_to_gradient_clipping() -> None:
    for kind in ("Adam", "AdamW", "adamw"):
        config = load_config({"optimizer": {"type": kind, "params": {"lr": 1e-3,
                                                                     "max_grad_norm": 1.0}}})
        assert config.optimizer is not None and "max_grad_norm" not in config.optimizer.params
        assert len(config.warnings) == 1 and "gradient_clipping" in config.warnings[0]
    with pytest.raises(ConfigError, match="optimizer.params.max_grad_norm"):  # SGD: an error
        load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "max_grad_norm": 1.0}}})


def test_refused_features_named_in_one_read() -> None:
    raw = {"train_batch_size": 8,
           "optimizer": {"type": "Lion", "params": {"lr": 1e-3}},
           "zero_optimization": {"zenflow": {"topk_ratio": 0.1}},
           "data_efficiency": {"enabled": True, "seed": 1234}}
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    message = str(info.value)
    assert "(3 problems)" in message
    for key in ("optimizer.type", "zero_optimization.zenflow", "data_efficiency"):
        assert key in message


class _Blocks(torch.nn.Module):
    """Matches no shipped tensor-parallel plan."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_autotp_loads_alone_and_the_plan_is_inferred_at_initialize() -> None:
    raw = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}
    config = load_config(raw)  # no model: the size is known, the plan waits
    assert (config.tensor_parallel.size, config.tensor_parallel.plan) == (2, None)
    assert config.dp_size(4) == 2
    inferred = load_config(config, model=_Blocks(), tp_plan=lambda: "hf_gpt2")
    assert (inferred.tensor_parallel.size, inferred.tensor_parallel.plan) == (2, "hf_gpt2")
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size = 2: no shipped"):
        load_config(config, model=_Blocks(), tp_plan=lambda: None)
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size = 2: no shipped"):
        meshzero.initialize(model=_Blocks(), config=config)  # the engine infers: none matches
    with pytest.raises(ConfigError, match="disagree"):
        load_config({"tensor_parallel": {"autotp_size": 2, "size": 4, "plan": "gpt"}})
    assert load_config({"tensor_parallel": {"autotp_size": 1}}).tensor_parallel.size == 1


def _gpt2() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=4, vocab_size=32, n_positions=8, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


AUTOTP_RAW = {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}}
TOKENS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))


def _autotp_rank(rank: int, world_size: int) -> tuple[str | None, list[float]]:
    config = load_config(AUTOTP_RAW)  # alone: the plan is inferred by initialize
    engine, *_ = meshzero.initialize(model=_gpt2(), config=config)
    losses = []
    for _ in range(3):
        loss = engine(input_ids=TOKENS, labels=TOKENS).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return engine.config.tensor_parallel.plan, losses  # type: ignore[return-value]


def test_autotp_loaded_alone_trains_as_the_unsharded_model(run_ranks) -> None:
    pytest.importorskip("transformers")
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(3):
        loss = model(input_ids=TOKENS, labels=TOKENS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for plan, losses in run_ranks(_autotp_rank, 2):
        assert plan == "hf_gpt2"
        assert losses == pytest.approx(want, rel=1e-5)


def test_zenflow_is_a_clear_refusal() -> None:
    """ZenFlow changes the update by design and is not built: refused by name, not as a
    misspelling of another zero_optimization key."""
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"},
            "zenflow": {"topk_ratio": 0.05, "update_interval": 4}}})
    message = str(info.value)
    assert "'zero_optimization.zenflow' asks for a DeepSpeed feature" in message
    assert "ZenFlow" in message and "did you mean" not in message

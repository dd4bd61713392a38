"""MeshzeroTrainer with the Trainer's ``torch_compile`` arguments (issue 35): they become the
config's "compile" section, the engine compiles each unit, the Trainer (Accelerate's dynamo
plugin) compiles nothing around it, and training equals the plain eager Trainer.

Accelerate hands a DeepSpeed engine the same three values (``Accelerator._prepare_deepspeed``
calls ``engine.compile(backend=..., compile_kwargs=dynamo_plugin.to_kwargs())``, DeepSpeed's
``DeepSpeedEngine.compile`` in deepspeed/runtime/engine.py); meshzero takes them through the
config before any work instead."""

from __future__ import annotations

import pytest
import torch

from meshzero import ConfigError
from meshzero.hf.config import resolve_compile
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 8, 4, 3
TOL = 1e-5  # fp32
# Adam divides by sqrt(v) + eps: with the default 1e-8, round-off on near-zero gradients
# (eager and compiled kernels sum in different orders) becomes lr-sized; 1e-4 keeps the
# comparison well-conditioned (as tests/ and benchmarks/gpu_check.py do)
EPS = 1e-4
# the Trainer accepts Accelerate's DynamoBackend names only; aot_eager keeps the test fast
BACKEND = "aot_eager"
MODE = "max-autotune-no-cudagraphs"  # aot_eager logs that it ignores it


def _args(out: str, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH, max_steps=STEPS,
                learning_rate=1e-2, adam_epsilon=EPS, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


# -- the config section from the arguments (in-process, no engine) -----------------------------
def test_torch_compile_fills_the_compile_section(tmp_path) -> None:
    args = _args(str(tmp_path), torch_compile=True, torch_compile_mode="reduce-overhead")
    got = resolve_compile({"zero_optimization": {"stage": 3}}, args)
    assert got["compile"] == {"enabled": True, "backend": "inductor",
                              "kwargs": {"mode": "reduce-overhead"}}
    # a backend alone turns compile on (TrainingArguments' own rule); no mode: none passed
    got = resolve_compile({}, _args(str(tmp_path), torch_compile_backend="aot_eager"))
    assert got["compile"] == {"enabled": True, "backend": "aot_eager"}
    # "auto" takes the arguments; the section's own kwargs are kept
    raw = {"compile": {"enabled": "auto", "backend": "auto",
                       "kwargs": {"mode": "auto", "fullgraph": True}}}
    got = resolve_compile(raw, _args(str(tmp_path), torch_compile_backend="aot_eager"))
    assert got["compile"] == {"enabled": True, "backend": "aot_eager",
                              "kwargs": {"fullgraph": True}}
    assert raw["compile"]["enabled"] == "auto"  # the caller's dict is left alone


def test_without_torch_compile_the_section_decides(tmp_path) -> None:
    args = _args(str(tmp_path))
    assert resolve_compile({"bf16": {"enabled": False}}, args) == {"bf16": {"enabled": False}}
    on = {"compile": {"enabled": True, "backend": "aot_eager"}}
    assert resolve_compile(on, args) == on  # the engine compiles, the Trainer does not
    got = resolve_compile({"compile": {"enabled": "auto", "backend": "auto"}}, args)
    assert got["compile"] == {"enabled": False, "backend": "inductor"}


def test_a_section_that_disagrees_fails_naming_both(tmp_path) -> None:
    args = _args(str(tmp_path), torch_compile_backend="aot_eager", torch_compile_mode="default")
    raw = {"compile": {"enabled": False, "backend": "inductor", "kwargs": {"mode": "max-autotune"}}}
    with pytest.raises(ConfigError) as err:
        resolve_compile(raw, args)
    msg = str(err.value)
    assert "'compile.enabled' = False" in msg and "torch_compile gives True" in msg
    assert "'compile.backend' = 'inductor'" in msg and "gives 'aot_eager'" in msg
    assert "'compile.kwargs.mode' = 'max-autotune'" in msg and "gives 'default'" in msg


# -- training: MeshzeroTrainer compiled against the plain eager Trainer ------------------------
def _llama():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0))


class _Rows(torch.utils.data.Dataset):
    """Token rows as a causal LM's training rows (labels: the input)."""

    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _record_compile_calls() -> list[tuple]:
    """torch.compile, recording the backend and keyword arguments of each call."""
    calls: list[tuple] = []
    original = torch.compile

    def recording(fn=None, **kwargs):
        calls.append((kwargs.get("backend"), kwargs.get("mode")))
        return original(fn, **kwargs)

    torch.compile = recording  # the rank's own process: nothing to restore
    return calls


def _history(trainer) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _train_compiled(rank: int, world_size: int, stage: int, out: str) -> tuple:
    from accelerate.utils import DynamoBackend

    from meshzero.hf import MeshzeroTrainer

    calls = _record_compile_calls()
    args = _args(out, per_device_train_batch_size=GLOBAL_BATCH // world_size,
                 torch_compile_backend=BACKEND, torch_compile_mode=MODE)
    trainer = MeshzeroTrainer(model=_llama(), args=args, train_dataset=_Rows(GLOBAL_BATCH * STEPS),
                              meshzero_config={"gradient_clipping": "auto", "zero_optimization": {
                                  "stage": stage, "stage3_param_persistence_threshold": 0}})
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    trainer.train()
    engine = trainer.engine
    assert engine is not None and trainer.model_wrapped is engine  # no OptimizedModule around
    return (_history(trainer), engine.full_state_dict(), engine.is_compiled, sorted(set(calls)),
            engine.compile_report())


@pytest.mark.parametrize("world_size,stage", [(1, 0), (2, 3),
                                              pytest.param(4, 3, marks=pytest.mark.slow)])
def test_torch_compile_trains_as_the_eager_trainer(tmp_path, world_size, stage) -> None:
    plain = transformers.Trainer(model=_llama(), args=_args(str(tmp_path / "plain")),
                                 train_dataset=_Rows(GLOBAL_BATCH * STEPS))
    plain.train()
    want = _history(plain)
    results = run_distributed(_train_compiled, world_size, tmp_path, stage, str(tmp_path / "mz"),
                              timeout=300)
    for history, weights, compiled, calls, report in results:
        assert compiled and report["units"] == 2 and report["backend"] == BACKEND
        assert report["graph_breaks"] == 0 and report["recompiles"] == 0
        assert calls == [(BACKEND, MODE)]  # one torch.compile (the decoder layers share it)
        assert len(history) == STEPS
        for (loss, norm), (want_loss, want_norm) in zip(history, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=TOL, abs=TOL)
            assert norm == pytest.approx(want_norm, rel=TOL, abs=TOL)
        for name, value in plain.model.state_dict().items():
            assert (weights[name] - value).abs().max().item() < TOL, name

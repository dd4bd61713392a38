"""Compiled units on Hugging Face causal LMs (issue 35): tiny Llama, Mistral and Mixtral built
from configs train under every ZeRO stage with their decoder layers compiled, 0 graph breaks
and nothing compiled after the first compiled step (dynamo's counters), equal to plain torch.

The configs set ``use_cache=False``, as training should: with a cache each decoder layer's
graph guards on its own ``layer_idx`` (the cache is indexed by it), so every layer would
compile a frame of its own (a recompile per layer, reported by ``engine.compile_report()``
and a WARNING naming dynamo's guard)."""

from __future__ import annotations

import copy

import pytest
import torch

import meshzero
from tests.compile_runs import assert_compiled_once
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, SEQ_LEN, VOCAB, LAYERS, LR = 3, 4, 12, 64, 2, 1e-2


def _hf_config(kind: str):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=32, bos_token_id=0, eos_token_id=0, use_cache=False)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if kind == "mixtral":  # 4 experts, top 2: the MoE routing compiles too
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(kind)


def _build(kind: str, reentrant: bool | None = None):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind))
    if reentrant is not None:  # HF's own activation checkpointing (GradientCheckpointingLayer)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
            for _ in range(STEPS)]


def _reference(kind: str) -> dict[str, torch.Tensor]:
    """Plain torch on one process over the whole global batch."""
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False, fused=False)
    for tokens in _batches():
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _train(rank: int, world_size: int, kind: str, stages: list[int],
           reentrant: bool | None = None) -> list:
    out = []
    micro = GLOBAL_BATCH // world_size
    for stage in stages:
        torch._dynamo.reset()
        cfg = zero_config(stage, global_batch=GLOBAL_BATCH, lr=LR,
                          compile={"enabled": True, "backend": "aot_eager"})
        engine, *_ = meshzero.initialize(model=_build(kind, reentrant),
                                         config=copy.deepcopy(cfg))
        reports = []
        for tokens in _batches():
            x = tokens[rank * micro:(rank + 1) * micro]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            reports.append(engine.compile_report())
        out.append((stage, engine.full_state_dict(), reports))
        engine.close()
    return out


def _check(results: list, ref: dict[str, torch.Tensor]) -> None:
    for rank_runs in results:
        for stage, params, reports in rank_runs:
            assert_compiled_once(reports, LAYERS, first_step=1 if stage == 3 else 0)
            for name, want in ref.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, s=stage: f"{s} {n}: {m}")


def test_llama_compiled_at_stage_3(tmp_path):
    results = run_distributed(_train, 2, tmp_path, "llama", [3], timeout=300)
    _check(results, _reference("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mistral", "mixtral"])
def test_hf_models_compiled_at_every_stage(tmp_path, kind):
    results = run_distributed(_train, 2, tmp_path, kind, [0, 1, 2, 3], timeout=900)
    _check(results, _reference(kind))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 4])
def test_llama_compiled_at_world_sizes_1_and_4(tmp_path, world_size):
    results = run_distributed(_train, world_size, tmp_path, "llama", [0, 3], timeout=900)
    _check(results, _reference("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_compiled(tmp_path, reentrant):
    """model.gradient_checkpointing_enable(): transformers' layer wrapper checkpoints inside
    ``forward``; meshzero runs that checkpoint eagerly around the compiled original forward
    (compile/checkpointing.py), so no graph break, and the recompute in backward compiles
    nothing new."""
    results = run_distributed(_train, 2, tmp_path, "llama", [0, 3], reentrant=reentrant,
                              timeout=600)
    _check(results, _reference("llama"))


def test_use_cache_is_warned_at_compile(caplog):
    """A transformers model with config.use_cache true: one WARNING when the units compile
    (no forward needed), since every layer would compile its own graph."""
    from meshzero.compile import UnitCompiler

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, use_cache=True))
    compiler = UnitCompiler(model, ["", "model.layers.0", "model.layers.1"])
    with caplog.at_level("WARNING", logger="meshzero.compile.units"):
        compiler.compile("eager")
    assert compiler.report()["units"] == 2
    assert any("use_cache" in r.getMessage() for r in caplog.records)

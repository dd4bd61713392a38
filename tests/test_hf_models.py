"""Hugging Face models (issue 8 item 2): ``transformers`` causal LMs built with
``from_config`` (no hub download) train under every ZeRO stage like one process, and
``save_pretrained`` safetensors load straight into the sharded engine."""

from __future__ import annotations

import copy

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config

transformers = pytest.importorskip("transformers")

STEPS = 3
GLOBAL_BATCH, SEQ_LEN, VOCAB = 4, 12, 64
LR = 1e-2


def _hf_config(kind: str):
    """Tiny configs, dropout off (ranks and the reference must see the same function)."""
    if kind == "gpt2":  # tied lm_head / wte: save_pretrained stores only transformer.wte.weight
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if kind == "llama":  # RMSNorm, rotary (a non-persistent buffer), grouped-query attention
        return transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
            bos_token_id=0, eos_token_id=0)
    raise ValueError(kind)


def _build(kind: str, seed: int):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_hf_config(kind))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
            for _ in range(STEPS)]


def _rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    micro = batch.shape[0] // world_size
    return batch[rank * micro:(rank + 1) * micro]


def _reference(kind: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch on one process over the whole global batch."""
    model = _build(kind, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False, fused=False)
    losses = []
    for tokens in _batches():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, losses


def _train_every_stage(rank: int, world_size: int, kind: str) -> list:
    out = []
    for stage in range(4):
        cfg = zero_config(stage, global_batch=GLOBAL_BATCH, lr=LR)
        engine, *_ = meshzero.initialize(model=_build(kind, 0), config=copy.deepcopy(cfg))
        losses = []
        for tokens in _batches():
            x = _rank_rows(tokens, rank, world_size)
            out_ = engine(input_ids=x, labels=x)  # kwargs reach the model; ModelOutput back
            engine.backward(out_.loss)
            engine.step()
            losses.append(out_.loss.item())
        out.append((stage, engine.full_state_dict(), losses))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_trains_like_single_process(tmp_path, kind):
    ref_params, ref_losses = _reference(kind)
    results = run_distributed(_train_every_stage, 2, tmp_path, kind, timeout=240)
    for stage in range(4):
        per_rank = [r[stage] for r in results]
        mean = [sum(losses[i] for _, _, losses in per_rank) / 2 for i in range(STEPS)]
        assert mean == pytest.approx(ref_losses, rel=1e-5), stage
        for _, params, _ in per_rank:
            assert params.keys() == ref_params.keys()
            for name, want in ref_params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, s=stage: f"{s} {n}: {m}")


def _load_pretrained(rank: int, world_size: int, kind: str, weights: str) -> list:
    tokens = _rank_rows(_batches()[0], rank, world_size)
    out = []
    for stage in range(4):
        cfg = zero_config(stage, global_batch=GLOBAL_BATCH)
        engine, *_ = meshzero.initialize(model=_build(kind, seed=99), config=cfg)
        engine.load_weights(weights)
        with torch.no_grad():
            loss = engine(input_ids=tokens, labels=tokens).loss.item()
        out.append((stage, loss, engine.full_state_dict()))
    # built on the meta device, materialised unit by unit with the model's own init scheme
    with meshzero.zero_init() as record:
        model = _build(kind, seed=99)
    record.init_fn = model._init_weights
    engine, *_ = meshzero.initialize(model=model, config=zero_config(3, global_batch=4))
    engine.load_weights(weights)
    with torch.no_grad():
        loss = engine(input_ids=tokens, labels=tokens).loss.item()
    out.append(("zero_init", loss, engine.full_state_dict()))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_pretrained_weights_load_into_the_sharded_model(tmp_path, kind):
    pretrained = _build(kind, seed=5)
    pretrained.save_pretrained(tmp_path / "hf", safe_serialization=True)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    want = pretrained.state_dict()
    results = run_distributed(_load_pretrained, 2, tmp_path, kind, str(tmp_path / "hf"),
                              timeout=240)
    with torch.no_grad():
        for rank, rank_results in enumerate(results):
            tokens = _rank_rows(_batches()[0], rank, 2)
            want_loss = pretrained(input_ids=tokens, labels=tokens).loss.item()
            for stage, loss, state in rank_results:
                assert loss == pytest.approx(want_loss, rel=1e-6), (stage, rank)
                for name, value in want.items():  # lm_head.weight too, through the tie
                    assert torch.equal(state[name], value), (stage, name)

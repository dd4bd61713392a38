"""Tensor parallelism (meshzero.parallel): training equals single-process training, shipped
plans reproduce the unsharded models, bad plans fail with the module named.

Every tp rank trains on the same batch; the reference is plain torch in this process. The
parallel model's shards are gathered back into full tensors under the original names
(``gather_tensor_parallel_state_dict``) and compared with the reference's state dict.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshzero.demo.gpt import GPT, GPTConfig
from meshzero.demo.gpt import loss_fn as gpt_loss
from meshzero.parallel import (
    GPT2_PLAN,
    GPT_PLAN,
    LLAMA_PLAN,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    gather_tensor_parallel_state_dict,
    is_tp_sharded,
)
from tests.models import MLPStack

GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
MLP_PLAN = {
    "input": "sequence_scatter",  # replicated; under SP its output enters the region
    "blocks.*.norm": "sequence_parallel",
    "blocks.*.fc1": "colwise",
    "blocks.*.fc2": "rowwise",
    "head": "colwise_gather",
}
STEPS = 3
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# --- models, data, training ------------------------------------------------------------------


def _setup(kind: str) -> tuple[nn.Module, dict, tuple[torch.Tensor, torch.Tensor], object]:
    """(model, plan, (input, target), loss) for a kind; the same on every process."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "gpt":
        model = GPT(GPT_CFG)
        idx = torch.randint(0, GPT_CFG.vocab_size, (2, 17), generator=gen)
        return model, GPT_PLAN, (idx[:, :-1], idx[:, 1:]), gpt_loss
    model = MLPStack(dim=16, hidden=24, num_blocks=2, out=8, in_dim=8)
    batch = (torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen))
    return model, MLP_PLAN, batch, F.mse_loss


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # eps 1e-4 (as tests/engine_runs.py): with Adam's 1e-8, an element whose gradient is a
    # near-exact cancellation (the key bias: softmax ignores a shift shared by all keys) turns
    # summation-order noise into lr-sized steps
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-4)


def _train(model: nn.Module, batch, loss_fn, opt_name: str) -> list[float]:
    opt = _optimizer(opt_name, model)
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _reference(kind: str, opt_name: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model, _, batch, loss_fn = _setup(kind)
    losses = _train(model, batch, loss_fn, opt_name)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _tp_train_rank(rank: int, world_size: int, kind: str, opt_name: str, sp: bool,
                   deep_copy: bool = False):
    model, plan, batch, loss_fn = _setup(kind)
    sent: dict[str, int] = {}

    def on_comm(op: str, nbytes: int) -> None:
        sent[op] = sent.get(op, 0) + nbytes

    apply_tensor_parallel(model, plan, dist.group.WORLD, sequence_parallel=sp, on_comm=on_comm)
    if deep_copy:  # a copy shares the group, keeps the marks, and reduces its own grads
        model = copy.deepcopy(model)
        assert is_tp_sharded(model.blocks[0].attn.qkv.weight)
    losses = _train(model, batch, loss_fn, opt_name)
    sent_per_step = {op: n // STEPS for op, n in sent.items()}
    return gather_tensor_parallel_state_dict(model, dist.group.WORLD), losses, sent_per_step


def _assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")


# --- equivalence -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "sp", "opt_name", "deep_copy"),
    [(2, False, "adamw", False), (2, True, "sgd", True), (4, True, "adamw", False),
     (4, False, "sgd", False)],
    ids=["tp2-adamw", "tp2-sp-sgd-deepcopy", "tp4-sp-adamw", "tp4-sgd"],
)
def test_gpt_training_matches_single_process(run_ranks, tp, sp, opt_name, deep_copy):
    want, want_losses = _reference("gpt", opt_name)
    results = run_ranks(_tp_train_rank, tp, "gpt", opt_name, sp, deep_copy)
    for state, losses, _ in results:
        _assert_same_state(state, want)
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("tp", "sp"), [(2, False), (2, True), (4, True)], ids=["tp2", "tp2-sp", "tp4-sp"]
)
def test_mlp_training_matches_single_process(run_ranks, tp, sp):
    want, want_losses = _reference("mlp", "adamw")
    results = run_ranks(_tp_train_rank, tp, "mlp", "adamw", sp)
    for state, losses, _ in results:
        _assert_same_state(state, want)
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    if not sp:
        # Per step, fp32, batch 8, dim 16, out 8, ring bytes (N-1)/N with N=2: all-reduces
        # of (8, 16): fc2 forward x2 blocks, fc1 backward x2, head backward; the head's
        # output (8, 8) all-gathered once.
        all_reduce = 5 * 2 * (8 * 16 * 4) // 2
        assert results[0][2] == {"all_reduce": all_reduce, "all_gather": 8 * 8 * 4 // 2}


def _gpt_generate_rank(rank: int, world_size: int):
    model, plan, batch, _ = _setup("gpt")
    apply_tensor_parallel(model, plan, dist.group.WORLD)
    return model(batch[0]), model.generate(batch[0][:, :8], max_new_tokens=4, temperature=0)


def test_gpt_forward_and_cached_generation_match(run_ranks):
    model, _, batch, _ = _setup("gpt")
    with torch.no_grad():
        want_logits = model(batch[0])
    want_tokens = model.generate(batch[0][:, :8], max_new_tokens=4, temperature=0)
    for logits, tokens in run_ranks(_gpt_generate_rank, 2):
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
        assert torch.equal(tokens, want_tokens)


# --- structure, one rank -------------------------------------------------------------------------


def test_tp1_keeps_the_model_and_marks_sharded_params():
    model, plan, batch, _ = _setup("gpt")
    ref = copy.deepcopy(model)
    calls: list[tuple[str, int]] = []
    model = apply_tensor_parallel(model, plan, None, on_comm=lambda op, n: calls.append((op, n)))
    assert isinstance(model.tok_emb, VocabParallelEmbedding)
    assert isinstance(model.blocks[0].attn.qkv, ColumnParallelLinear)
    assert isinstance(model.blocks[0].mlp.proj, RowParallelLinear)
    assert model.head.weight is model.tok_emb.weight  # still tied
    assert is_tp_sharded(model.blocks[0].attn.qkv.bias)
    assert is_tp_sharded(model.blocks[0].mlp.proj.bias) is False  # replicated, added once
    assert not is_tp_sharded(model.ln_f.weight)
    assert model.state_dict().keys() == ref.state_dict().keys()
    torch.testing.assert_close(model(batch[0]), ref(batch[0]))
    assert calls == []


def test_plan_errors_name_the_pattern_or_module():
    def apply(plan, model=None):
        return apply_tensor_parallel(model or _setup("gpt")[0], plan, None)

    with pytest.raises(ValueError, match=r"'blocks\.\*\.attn\.qkvz' matches no module.*qkv"):
        apply({**GPT_PLAN, "blocks.*.attn.qkvz": "colwise"})
    with pytest.raises(ValueError, match="unknown style 'columnwise'"):
        apply({"head": "columnwise"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['split'\]"):
        apply({"head": {"style": "colwise", "split": 2}})
    with pytest.raises(ValueError, match="'ln_f': style 'vocab' needs an nn.Embedding"):
        apply({"ln_f": "vocab"})
    with pytest.raises(ValueError, match="'head' matches two .* 'head' and 'he\\*'"):
        apply({"head": "colwise", "he*": "colwise"})
    # the head is sharded but its tied twin, the token embedding, would stay whole
    plan = {k: v for k, v in GPT_PLAN.items() if k != "tok_emb"}
    with pytest.raises(ValueError, match="tok_emb.weight is tied to head.weight"):
        apply(plan)
    with pytest.raises(ValueError, match="tied to .* shards them differently"):
        apply({**GPT_PLAN, "tok_emb": "vocab", "head": "rowwise"})


def _divisibility_rank(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    messages = []
    bad = [
        (GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=3, n_embd=48)), GPT_PLAN),
        (GPT(GPTConfig(vocab_size=63, block_size=8, n_layer=1, n_head=2, n_embd=16)), GPT_PLAN),
        (MLPStack(dim=16, hidden=25, num_blocks=1, out=8, in_dim=8), MLP_PLAN),
    ]
    for model, plan in bad:
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError) as info:
            apply_tensor_parallel(model, plan, group)
        messages.append(str(info.value))
        # checked before anything changed
        assert not any(isinstance(m, ColumnParallelLinear) for m in model.modules())
        _assert_same_state(model.state_dict(), before)
    model, plan, _, _ = _setup("gpt")
    apply_tensor_parallel(model, plan, group, sequence_parallel=True)
    with pytest.raises(ValueError) as info:
        model(torch.zeros(2, 7, dtype=torch.long))  # 7 positions over 2 ranks
    messages.append(str(info.value))
    return messages


def test_sizes_not_divisible_by_tp_name_the_module(run_ranks):
    heads, vocab, hidden, seq = run_ranks(_divisibility_rank, 2)[0]
    assert "'blocks.0.attn': n_head 3 is not divisible by the tensor-parallel size 2" in heads
    assert "'tok_emb': num_embeddings (vocabulary) 63 is not divisible" in vocab
    assert "'blocks.0.fc1': out_features 25 is not divisible" in hidden
    assert "size 7 of dimension -2" in seq and "tensor-parallel size 2" in seq


# --- Hugging Face models ---------------------------------------------------------------------


def _hf_step_matches(model: nn.Module, plan: dict, ids: torch.Tensor, sp: bool) -> None:
    """Logits, then one SGD step with lr 1 (parameters minus gradients), of the sharded model
    equal those of the unsharded one; gathered weights have the original names and shapes."""
    group = dist.group.WORLD
    ref = copy.deepcopy(model)
    apply_tensor_parallel(model, plan, group, sequence_parallel=sp)
    logits = []
    for m in (ref, model):
        out = m(ids, labels=ids)  # the models' own shifted next-token loss on full logits
        out.loss.backward()
        torch.optim.SGD(m.parameters(), lr=1.0).step()
        logits.append(out.logits.detach())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    _assert_same_state(gather_tensor_parallel_state_dict(model, group), ref.state_dict())


def _hf_rank(rank: int, world_size: int) -> dict[str, str]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    gpt2_cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                          eos_token_id=0)
    for sp in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(gpt2_cfg)
        _hf_step_matches(model, GPT2_PLAN, ids, sp)  # Conv1D weights come back (in, out)
        assert model.lm_head.weight is model.transformer.wte.weight
    llama_cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    for tie in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**llama_cfg, tie_word_embeddings=tie))
        _hf_step_matches(model, LLAMA_PLAN, ids, sp=False)
    errors = {}
    for cfg, sp in ((dict(llama_cfg, num_key_value_heads=1), False), (llama_cfg, True)):
        with pytest.raises(ValueError) as info:
            apply_tensor_parallel(LlamaForCausalLM(LlamaConfig(**cfg)), LLAMA_PLAN,
                                  dist.group.WORLD, sequence_parallel=sp)
        errors[f"sp={sp}"] = str(info.value)
    return errors


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hf_gpt2_and_llama_match_unsharded_tp2(run_ranks):
    for errors in run_ranks(_hf_rank, 2):
        assert ("'model.layers.0.self_attn': num_key_value_heads 1 is not divisible"
                in errors["sp=False"])
        assert "sequence parallelism is not supported by the Llama plan" in errors["sp=True"]

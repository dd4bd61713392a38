"""Ulysses sequence parallelism (issue 28): the all-to-all attention equals attention over
the unsharded sequence (values and gradients, GQA included), the token-weighted loss equals
the full-sequence loss, and training at sp = 2, 4 x dp = 1, 2 at ZeRO stages 0-3 equals one
plain-torch process on the full sequences (our GPT and a tiny Hugging Face Llama with GQA).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshzero
from meshzero.config import ConfigError, load_config
from meshzero.config.batch import data_parallel_size
from meshzero.demo.gpt import GPT, GPTConfig
from meshzero.demo.gpt import loss_fn as gpt_loss
from meshzero.estimate import Estimator, load_model, settings_from_config
from meshzero.parallel.sequence import SequenceParallel, route_attention_modules
from tests.engine_runs import ADAM_EPS, zero_config

GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
STEPS, MICRO, SEQ, LR = 2, 2, 16, 1e-2
B, T, D = 2, 8, 4  # the attention unit tests
# (heads, kv heads): plain, kv split like q, kv replicated to sp (fewer kv heads than sp)
HEADS = [(4, 4), (4, 2), (8, 1)]


# --- the attention all-to-all and the loss, against the unsharded computation ---------------


def _qkv(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(B, heads, T, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, T, D, generator=gen) for _ in range(2))
    weight = torch.randn(B, heads, T, D, generator=gen)  # a loss that weighs every output
    return q, k, v, weight


def _attention_rank(rank: int, world_size: int) -> dict:
    sent: dict[str, int] = {}

    def count(op: str, nbytes: int) -> None:
        sent[op] = sent.get(op, 0) + nbytes

    sp = SequenceParallel(dist.group.WORLD, world_size, rank, on_comm=count)
    out = {}
    for heads, kv_heads in HEADS:
        q, k, v, weight = (sp.shard(t, dim=2).clone() for t in _qkv(heads, kv_heads))
        for t in (q, k, v):
            t.requires_grad_(True)
        sent.clear()
        y = sp.sdpa(q, k, v, is_causal=True)
        (y * weight).sum().backward()
        out[(heads, kv_heads)] = (y.detach(), q.grad, k.grad, v.grad, dict(sent))
    # the token-weighted loss: ranks with different numbers of counted tokens
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, 5, generator=gen)
    target = torch.randint(0, 5, (B, T), generator=gen)
    target[:, T // 2 + 1:] = -100  # padding at the end: later ranks count fewer tokens
    local = sp.shard(logits).clone().requires_grad_(True)
    sp.full_length = T
    loss = sp.loss(lambda o, t: F.cross_entropy(o.reshape(-1, 5), t.reshape(-1)), local, target)
    loss.backward()
    out["loss"] = (loss.detach(), local.grad)
    # seq_parallel_communication_data_type bf16: half the bytes on the wire
    wire = SequenceParallel(dist.group.WORLD, world_size, rank, torch.bfloat16, on_comm=count)
    q, k, v, _ = (wire.shard(t, dim=2) for t in _qkv(4, 4))
    sent.clear()
    out["bf16"] = (wire.sdpa(q, k, v, is_causal=True), dict(sent))
    # a plan: SDPA routed inside the named modules of a model that never heard of sp
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    plan = SequenceParallel(dist.group.WORLD, world_size, rank)
    hooks = route_attention_modules(model, plan, ("blocks.*.attn",))
    idx = torch.arange(SEQ).remainder(GPT_CFG.vocab_size).view(1, SEQ)
    chunk = SEQ // world_size
    with torch.no_grad():
        out["plan"] = model(plan.shard(idx), position_ids=torch.arange(
            rank * chunk, (rank + 1) * chunk).view(1, chunk))
    out["plan_hooks"] = (len(hooks), plan.routes_sdpa)
    return out


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_attention_and_loss_equal_unsharded(run_ranks, world_size):
    results = run_ranks(_attention_rank, world_size)
    c = T // world_size
    for heads, kv_heads in HEADS:
        q, k, v, weight = (t.clone().requires_grad_(True) for t in _qkv(heads, kv_heads))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=heads != kv_heads)
        (y * weight).sum().backward()
        for rank, res in enumerate(results):
            got_y, gq, gk, gv, sent = res[(heads, kv_heads)]
            part = slice(rank * c, (rank + 1) * c)
            for got, want in ((got_y, y), (gq, q.grad), (gk, k.grad), (gv, v.grad)):
                torch.testing.assert_close(got, want[:, :, part], rtol=1e-5, atol=1e-6)
            # forward: q, k, v seq->heads and the output back; backward the same again;
            # each sends (sp-1)/sp of its tensor (kv replicated up to sp heads first)
            kv_sent = max(kv_heads, world_size)
            elems = 2 * (2 * B * heads * c * D + 2 * B * kv_sent * c * D)
            assert sent == {"all_to_all": elems * 4 * (world_size - 1) // world_size}
    logits = torch.randn(B, T, 5, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, 5, generator=gen).requires_grad_(True)
    target = torch.randint(0, 5, (B, T), generator=gen)
    target[:, T // 2 + 1:] = -100
    want = F.cross_entropy(logits.reshape(-1, 5), target.reshape(-1))
    want.backward()
    y = F.scaled_dot_product_attention(*_qkv(4, 4)[:3], is_causal=True)
    torch.manual_seed(0)
    with torch.no_grad():
        full = GPT(GPT_CFG)(torch.arange(SEQ).remainder(GPT_CFG.vocab_size).view(1, SEQ))
    for rank, res in enumerate(results):
        got, sent = res["bf16"]
        torch.testing.assert_close(got, y[:, :, rank * c:(rank + 1) * c], rtol=0, atol=3e-2)
        assert sent == {"all_to_all": 4 * B * 4 * c * D * 2 * (world_size - 1) // world_size}
        chunk = SEQ // world_size
        torch.testing.assert_close(res["plan"], full[:, rank * chunk:(rank + 1) * chunk],
                                   rtol=1e-5, atol=1e-6)
        assert res["plan_hooks"] == (2 * GPT_CFG.n_layer, False)
    for rank, res in enumerate(results):
        loss, grad = res["loss"]
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
        # each rank backwards the same loss: its chunk's gradient is sp times the true one,
        # which ZeRO's average over dp x sp divides back
        part = slice(rank * c, (rank + 1) * c)
        torch.testing.assert_close(grad, world_size * logits.grad[:, part], rtol=1e-5,
                                   atol=1e-7)


def _bad_shapes_rank(rank: int, world_size: int) -> list[str]:
    errors = []
    cfg = zero_config(0, global_batch=2, sequence_parallel_size=world_size)
    for model in (GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=3, n_embd=12)),
                  _llama_with(num_attention_heads=8, num_key_value_heads=3)):
        try:  # at initialize, before any work
            meshzero.initialize(model=model, config=copy.deepcopy(cfg))
        except ValueError as exc:
            errors.append(str(exc))
    engine, *_ = meshzero.initialize(model=_OddHeads(), config=copy.deepcopy(cfg))
    try:  # found at the first forward: the error names the module that called SDPA
        engine(torch.randn(1, 4, 12))
    except ValueError as exc:
        errors.append(str(exc))
    sp = SequenceParallel(dist.group.WORLD, world_size, rank)
    try:  # a loader sharded over every rank: the sp ranks got different samples
        sp.shard_inputs(GPT(GPT_CFG), (torch.full((1, 4), rank),), {})
    except ValueError as exc:
        errors.append(str(exc))
    for q_heads, kv_heads, length in ((3, 3, 4), (4, 3, 4), (4, 4, 5)):
        q = torch.randn(1, q_heads, length, 2)
        k = torch.randn(1, kv_heads, length, 2)
        try:
            sp.sdpa(sp.shard(q, 2), sp.shard(k, 2), sp.shard(k, 2), where="blocks.0.attn")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_shapes_are_clear_errors(run_ranks):
    pytest.importorskip("transformers")
    errors = run_ranks(_bad_shapes_rank, 2)[0]
    assert len(errors) == 7
    assert "blocks.0.attn.n_head = 3 attention heads are not divisible by " \
        "sequence_parallel_size 2" in errors[0]
    assert "LlamaForCausalLM.config.num_key_value_heads = 3 key/value heads can be neither " \
        "split over nor replicated to sequence_parallel_size 2" in errors[1]
    assert errors.pop(2).startswith("_OddHeads: 3 attention heads are not divisible")
    assert "the ranks of a sequence-parallel group passed different micro-batches " \
        "((batch, length, sum) per rank: [[1.0, 4.0, 0.0], [1.0, 4.0, 4.0]])" in errors[2]
    assert "blocks.0.attn: 3 attention heads are not divisible by sequence_parallel_size 2" \
        in errors[3]
    assert "3 key/value heads can be neither split over nor replicated" in errors[4]
    assert "sequence length 5 is not divisible by sequence_parallel_size 2" in errors[5]


def test_config_errors():
    with pytest.raises(ConfigError, match="sequence_parallel_size = 2 with tensor_parallel"):
        load_config({"sequence_parallel_size": 2,
                     "tensor_parallel": {"size": 2, "plan": "gpt"}})
    with pytest.raises(ConfigError, match="sequence_parallel_size = 2 with pipeline"):
        load_config({"sequence_parallel_size": 2, "pipeline_parallel": {"size": 2}})
    with pytest.raises(ConfigError, match="seq_parallel_communication_data_type"):
        load_config({"seq_parallel_communication_data_type": "int8"})
    with pytest.raises(ConfigError, match=r"sequence_parallel_size \(4\) = 4 does not divide "
                       r"the world size 6.*sp x tp x pp x dp = 6"):
        data_parallel_size(6, 1, 1, 4)
    cfg = load_config({"sequence_parallel_size": 2, "train_batch_size": 4,
                       "seq_parallel_communication_data_type": "bf16"})
    assert cfg.dp_size(8) == 4 and cfg.resolve_batch(cfg.dp_size(8)) == (4, 1, 1)
    assert cfg.sequence_comm_dtype == torch.bfloat16


# --- training equals one plain-torch process on the full sequences --------------------------


def _gpt_model() -> GPT:
    return GPT(GPT_CFG)


def _gpt_batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    idx = [torch.randint(0, GPT_CFG.vocab_size, (MICRO * dp, SEQ + 1), generator=gen)
           for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in idx]


def _gpt_reference(dp: int) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for x, y in _gpt_batches(dp):
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _gpt_rank(rank: int, world_size: int, runs: tuple[tuple[int, int], ...]) -> list:
    """Train each (sp, stage) of ``runs``."""
    out = []
    for sp, stage in runs:
        dp = world_size // sp
        torch.manual_seed(0)  # the reference's initial weights
        cfg = zero_config(stage, global_batch=MICRO * dp, lr=LR, sequence_parallel_size=sp)
        engine, *_ = meshzero.initialize(model=GPT(GPT_CFG), config=copy.deepcopy(cfg))
        assert engine.sequence_parallel is not None
        rows = slice(engine.topology.dp_rank * MICRO, (engine.topology.dp_rank + 1) * MICRO)
        losses = []
        for x, y in _gpt_batches(dp):  # every sp rank passes the same full micro-batch
            logits = engine(x[rows])
            assert logits.shape[1] == SEQ // sp
            loss = engine.sequence_parallel.loss(gpt_loss, logits, y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append((sp, stage, engine.full_state_dict(), losses, engine.comm_report(),
                    engine.memory_report()))
        engine.close()
    return out


def _assert_matches(results: list, reference) -> None:
    """Every rank's parameters equal the reference's; the ranks of an sp group return the
    same loss (their replica's micro-batch), whose mean over dp is the reference's."""
    for i, (sp, stage, *_) in enumerate(results[0]):
        want_state, want_losses = reference(sp)
        where = f"sp={sp} stage={stage}"
        losses = torch.tensor([rank_out[i][3] for rank_out in results])  # (world, steps)
        by_replica = losses.view(-1, sp, losses.shape[1])  # ranks: dp outer, sp inner
        torch.testing.assert_close(by_replica, by_replica[:, :1].expand_as(by_replica))
        torch.testing.assert_close(by_replica[:, 0].mean(0), torch.tensor(want_losses),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
        for rank_out in results:
            state = rank_out[i][2]
            for name, want in want_state.items():
                torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, w=where: f"{w} {n}: {m}")


ALL_STAGES = tuple((sp, stage) for sp in (2, 4) for stage in range(4))


@pytest.mark.parametrize(("world_size", "runs"), [
    (4, ((2, 1), (4, 3))),  # sp 2 x dp 2 and sp 4 x dp 1
    pytest.param(2, tuple((2, stage) for stage in range(4)), marks=pytest.mark.slow),
    pytest.param(4, ALL_STAGES, marks=pytest.mark.slow),
])
def test_gpt_equals_single_process(run_ranks, world_size, runs):
    results = run_ranks(_gpt_rank, world_size, runs, timeout=600)
    refs = {sp: _gpt_reference(world_size // sp) for sp in {sp for sp, _ in runs}}
    _assert_matches(results, lambda sp: refs[sp])
    estimator = Estimator(load_model(_gpt_model))
    for rank, rank_out in enumerate(results):
        for sp, stage, _, _, comm, memory in rank_out:
            # the estimator's model states (ZeRO over dp x sp) are what the engine holds
            cfg = zero_config(stage, global_batch=MICRO * world_size // sp, lr=LR,
                              sequence_parallel_size=sp)
            want = estimator.states(settings_from_config(cfg, world_size), world_size)
            assert want.report(rank) == {k: memory[k] for k in want.report(rank)}
            # comm_report counts the all-to-alls of the last step
            # per layer: q, k, v and the output, (B, T/sp, C) each, forward and backward;
            # a rank sends (sp-1)/sp of each
            elems = 2 * GPT_CFG.n_layer * 4 * MICRO * (SEQ // sp) * GPT_CFG.n_embd
            assert comm["all_to_all"]["bytes"] == elems * 4 * (sp - 1) // sp, (sp, stage)
            assert comm["all_to_all"]["count"] == 2 * GPT_CFG.n_layer * 4


# --- a Hugging Face Llama (GQA), through transformers' attention-function registry --------


def _llama(seed: int = 0):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(  # 4 query heads, 2 kv heads: split at sp 2, copied at 4
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _llama_batches(dp: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (MICRO * dp, SEQ), generator=gen) for _ in range(STEPS)]


def _llama_reference(dp: int) -> tuple[dict, list[float]]:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS)
    losses = []
    for tokens in _llama_batches(dp):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _llama_rank(rank: int, world_size: int, runs: tuple[tuple[int, int], ...]) -> list:
    """Train each (sp, stage) of ``runs``."""
    out = []
    for sp, stage in runs:
        dp = world_size // sp
        cfg = zero_config(stage, global_batch=MICRO * dp, lr=LR, sequence_parallel_size=sp)
        engine, *_ = meshzero.initialize(model=_llama(), config=copy.deepcopy(cfg))
        assert engine.module.config._attn_implementation == "meshzero_ulysses"
        rows = slice(engine.topology.dp_rank * MICRO, (engine.topology.dp_rank + 1) * MICRO)
        losses = []
        for tokens in _llama_batches(dp):
            res = engine(input_ids=tokens[rows], labels=tokens[rows])  # the full rows
            assert res.logits.shape[1] == SEQ // sp
            engine.backward(res.loss)
            engine.step()
            losses.append(res.loss.item())
        out.append((sp, stage, engine.full_state_dict(), losses, None, None))
        engine.close()
    return out


@pytest.mark.parametrize("runs", [
    ((2, 2), (4, 0)),  # kv heads split over sp 2, copied to sp 4
    pytest.param(ALL_STAGES, marks=pytest.mark.slow),
])
def test_hf_llama_equals_single_process(run_ranks, runs):
    pytest.importorskip("transformers")
    results = run_ranks(_llama_rank, 4, runs, timeout=600)
    refs = {sp: _llama_reference(4 // sp) for sp in (2, 4)}
    _assert_matches(results, lambda sp: refs[sp])


def _llama_with(**overrides):
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=24, intermediate_size=32, num_hidden_layers=1, vocab_size=16,
        **overrides))


def _checkpoint_rank(rank: int, world_size: int, path: str) -> list[bool]:
    """Save at sp = 2 (ZeRO-3 over dp x sp: one file per rank), load at sp = 1 (dp = 2) and
    at sp = 2 again."""
    x, y = _gpt_batches(1)[0]
    cfg = zero_config(3, global_batch=MICRO, lr=LR, sequence_parallel_size=2,
                      flops_profiler={"enabled": True, "profile_step": 0,
                                      "output_file": f"{path}-profile-{rank}.txt"})
    engine, *_ = meshzero.initialize(model=GPT(GPT_CFG), config=copy.deepcopy(cfg))
    engine.backward(engine.sequence_parallel.loss(gpt_loss, engine(x), y))
    engine.step()
    report = engine.last_profile
    assert report is not None
    profile = (report.sequence_parallel_size, report.tokens_per_rank, report.fwd_flops_model)
    engine.save_checkpoint(path, tag="t")
    want = engine.full_state_dict()
    engine.close()
    same = []
    for sp, stage in ((1, 2), (2, 3)):
        cfg = zero_config(stage, global_batch=MICRO * world_size // sp, lr=LR,
                          sequence_parallel_size=sp)
        torch.manual_seed(1)  # other weights: the load must replace them
        other, *_ = meshzero.initialize(model=GPT(GPT_CFG), config=copy.deepcopy(cfg))
        other.load_checkpoint(path, tag="t")
        got = other.full_state_dict()
        same.append(all(torch.equal(got[k], want[k]) for k in want))
        other.close()
    return [*same, profile]


def test_checkpoint_saved_at_sp_loads_anywhere(run_ranks, tmp_path):
    """... and the profiler reports sp, tokens per rank, and the model's FLOPs (the sum over
    the sp ranks) as one process on the whole sequences counts them."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    results = run_ranks(_checkpoint_rank, 2, str(tmp_path / "ckpt"))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        GPT(GPT_CFG)(_gpt_batches(1)[0][0])
    # torch's counter has no formula for the CPU SDPA kernel; meshzero's profiler does
    heads = (MICRO, GPT_CFG.n_head, SEQ, GPT_CFG.n_embd // GPT_CFG.n_head)
    want = counter.get_total_flops() + GPT_CFG.n_layer * sdpa_flop_count(heads, heads, heads)
    for same_at_sp1, same_at_sp2, profile in results:
        assert same_at_sp1 and same_at_sp2
        assert profile == (2, MICRO * SEQ // 2, want)
    assert "sequence-parallel size (Ulysses):" in (tmp_path / "ckpt-profile-0.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "t").glob("rank*.safetensors")) == [
        "rank00000.safetensors", "rank00001.safetensors"]


def test_estimator_activations_fall_with_sp():
    """One rank's activations: seq_len / sp tokens, attention over the whole sequence on
    H / sp heads; at this size they fall about as 1 / sp."""
    estimator = Estimator(load_model(_gpt_model))
    got = {}
    for sp in (1, 2, 4):
        settings = settings_from_config({"sequence_parallel_size": sp}, 4, seq_len=SEQ,
                                        micro_batch=4)
        got[sp] = estimator.activation_bytes(settings, 4)
    assert got[1] > got[2] > got[4]
    assert 0.45 < got[2] / got[1] < 0.6 and 0.2 < got[4] / got[1] < 0.35, got
    with pytest.raises(ValueError, match="sequence_parallel_size 4 needs a sequence length "
                       "divisible by it, got 6"):
        estimator.activation_bytes(settings_from_config(
            {"sequence_parallel_size": 4}, 4, seq_len=6), 1)


def test_estimate_takes_sp(capsys):
    from meshzero.cli import main

    # a small GPU: the search for the largest micro batch that fits stays short
    args = ["meshzero.demo.gpt:GPT", "--gpus-per-node", "4", "--gpu-memory", "200MB",
            "--stage", "3", "--seq-len", "128", "--micro-batch", "4"]
    assert main(["estimate", *args, "--sp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["sp"] == 2
    assert main(["estimate", *args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert data["activations"] < 0.6 * plain["activations"]
    assert main(["estimate", *args, "--sp", "2"]) == 0
    assert "sp 2 (Ulysses: seq len / 2 per rank, ZeRO over dp x sp)" in capsys.readouterr().out
    assert main(["estimate", *args, "--sp", "3"]) == 1
    assert "sequence_parallel_size (3) = 3 does not divide the world size 4" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_plan_takes_sp(capsys):
    from meshzero.cli import main

    assert main(["plan", "meshzero.demo.gpt:GPT", "--gpus-per-node", "4", "--seq-len", "128",
                 "--sp", "2", "--top", "3"]) == 0
    assert "configurations fit" in capsys.readouterr().out


class _OddHeads(torch.nn.Module):
    """Attention with 3 heads and no attribute that says so."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(12, 36)

    def forward(self, x, position_ids=None):
        q, k, v = self.attn(x).view(*x.shape[:2], 3, 3, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _HFLike(torch.nn.Module):
    """A forward with transformers' shape: keyword inputs and **kwargs for the loss."""

    def forward(self, input_ids, position_ids=None, labels=None, attention_mask=None, **kwargs):
        return input_ids


def test_inputs_are_cut_with_positions_labels_and_masks(no_default_group):
    """What a rank's forward gets (no communication: rank 1 of a group of 2; group None must
    not fall back on a default group an earlier in-process test left behind)."""
    sp = SequenceParallel(None, 2, 1)
    model = GPT(GPT_CFG)
    ids = torch.arange(16).view(2, 8)
    args, kwargs, counted = sp.shard_inputs(model, (ids,), {})
    assert torch.equal(args[0], ids[:, 4:]) and counted is None
    assert torch.equal(kwargs["position_ids"], torch.arange(4, 8).expand(2, 4))
    labels = ids.clone()
    labels[1, 6:] = -100  # padding at the end
    mask = (labels != -100).long()
    # a forward without shift_labels (or **kwargs) gets its labels cut, not shifted
    _, kwargs, counted = sp.shard_inputs(model, (ids,), {"labels": labels})
    assert torch.equal(kwargs["labels"], labels[:, 4:]) and "shift_labels" not in kwargs
    _, kwargs, counted = sp.shard_inputs(_HFLike(), (), {"input_ids": ids, "labels": labels,
                                                         "attention_mask": mask})
    # shifted before the cut: the chunk's last position predicts nothing (end of sequence)
    assert kwargs["shift_labels"].tolist() == [[5, 6, 7, -100], [13, -100, -100, -100]]
    assert kwargs["attention_mask"] is None and int(counted) == 4
    with pytest.raises(ValueError, match="padding other than at the end"):
        sp.shard_inputs(model, (ids,), {"attention_mask": mask.flip(1)})
    presharded = {"position_ids": torch.arange(4, 8).expand(2, 4)}
    assert sp.shard_inputs(model, (ids[:, 4:],), presharded)[1] is presharded
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by "
                       "sequence_parallel_size 2; pad the sequences"):
        sp.shard_inputs(model, (ids[:, :7],), {})
    with pytest.raises(ValueError, match="Linear.forward takes no position_ids: under "
                       "sequence_parallel_size 2 rank 1 holds positions 4..7"):
        sp.shard_inputs(torch.nn.Linear(8, 8), (torch.randn(2, 8, 8),), {})

"""Pipeline parallelism (meshzero.parallel.pipeline): stage splitting, bad input, and
equivalence: N optimizer steps of a pipeline over pp ranks equal one process training the
same model on the same global batch (tests.models.reference_train, plain torch)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshzero.demo.gpt import GPT, GPTConfig
from meshzero.demo.gpt import loss_fn as gpt_loss
from meshzero.demo.layout import GPT_LAYOUT
from meshzero.parallel.pipeline import (
    PipelineLayout,
    build_pipeline,
    schedule_class,
    split_stages,
)
from meshzero.parallel.pipeline_state import gather_pipeline_state_dict
from tests.models import Block, make_batches, mlp_loss, reference_train

STEPS = 3
MICRO_BATCHES = 4
GLOBAL_BATCH = 8  # 4 micro-batches of 2
LR, WEIGHT_DECAY, EPS = 1e-2, 0.01, 1e-4  # eps as tests.engine_runs.ADAM_EPS
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def _mlp_chain() -> nn.Sequential:
    """Linear(7, 16) -> 4 x Block(16, 24) -> Linear(16, 5): 6 layers, 3613 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), *(Block(16, 24) for _ in range(4)), nn.Linear(16, 5))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def _gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, GPT_CFG.block_size)
    return [
        (torch.randint(0, GPT_CFG.vocab_size, shape, generator=gen),
         torch.randint(0, GPT_CFG.vocab_size, shape, generator=gen))
        for _ in range(STEPS)
    ]


# kind -> (model factory, layout, loss, batches)
CASES = {
    "mlp": (_mlp_chain, None, mlp_loss, lambda: make_batches("mlp", STEPS, GLOBAL_BATCH)),
    "gpt": (_gpt, GPT_LAYOUT, gpt_loss, _gpt_batches),
}


@functools.cache
def _reference(kind: str):
    factory, _, loss, batches = CASES[kind]
    return reference_train(factory, batches(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                           loss_fn=loss)


def _train_pipeline(rank: int, world_size: int, kind: str, schedule: str,
                    stages_per_rank: int | None) -> dict:
    factory, layout, loss, batches = CASES[kind]
    model = factory()
    all_names = [n for n, _ in model.named_parameters()]
    batches = batches()
    pipe = build_pipeline(
        model, pp_group=dist.group.WORLD, layout=layout, schedule=schedule,
        micro_batches=MICRO_BATCHES, loss_fn=loss, stages_per_rank=stages_per_rank,
        example_inputs=batches[0][0][: GLOBAL_BATCH // MICRO_BATCHES],
    )
    # Only this rank's layers are kept; the others' storage is gone.
    local = {id(p) for p in pipe.module.parameters()}
    assert all(p.numel() == 0 for p in model.parameters() if id(p) not in local)
    opt = torch.optim.AdamW(pipe.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                            eps=EPS, foreach=False, fused=False)
    losses = []
    for x, y in batches:
        # Every rank has the whole batch here; only the first / last stage's ranks use it.
        losses.append(pipe.step(x, y, broadcast_loss=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = gather_pipeline_state_dict(pipe, dst=0)
    everywhere = gather_pipeline_state_dict(pipe)  # every rank: the full model, loadable
    assert (state is None) == (rank != 0)
    assert list(everywhere) == list(model.state_dict())
    factory().load_state_dict(everywhere)
    local_names = [n for n, _ in pipe.module.named_parameters()]
    assert set(local_names) <= set(all_names) | {"head.weight"}
    owned = sum(p.numel() for p in pipe.module.parameters() if pipe.owns_parameter(p))
    return {"losses": torch.stack(losses), "state": state, "names": local_names,
            "stages": pipe.stage_indices, "owned": owned}


def _check_equivalence(results: list[dict], kind: str) -> None:
    ref = _reference(kind)
    for r, res in enumerate(results):  # every pp rank logged the same (broadcast) losses
        torch.testing.assert_close(res["losses"], torch.tensor(ref.losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, r=r: f"rank {r} losses: {m}")
    state = results[0]["state"]
    for name, want in ref.params.items():
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # Every rank holds a different, non-empty part; together they are the whole model.
    names = [set(res["names"]) for res in results]
    assert all(names)
    assert set().union(*names) >= set(ref.params)
    # owns_parameter counts a tied tensor on one rank only: the model's count, exactly.
    assert sum(res["owned"] for res in results) == sum(p.numel() for p in ref.params.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_pp2_equals_single_process(run_ranks, kind, schedule):
    results = run_ranks(_train_pipeline, 2, kind, schedule, None)
    _check_equivalence(results, kind)
    if kind == "gpt":  # the tied embedding/head lives at both ends
        assert "tok_emb.weight" in results[0]["names"]
        assert "head.weight" in results[1]["names"]
        assert torch.equal(results[0]["state"]["tok_emb.weight"],
                           results[0]["state"]["head.weight"])


def test_pp4_equals_single_process(run_ranks):
    results = run_ranks(_train_pipeline, 4, "mlp", "1f1b", None)
    _check_equivalence(results, "mlp")
    assert [res["stages"] for res in results] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "schedule",
    ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"],
)
def test_virtual_stages_equal_single_process(run_ranks, schedule):
    """2 ranks x 2 stages of the GPT: looped (stages 0, 2 | 1, 3) or V-shaped (0, 3 | 1, 2,
    where rank 0 holds both ends of the tied embedding)."""
    results = run_ranks(_train_pipeline, 2, "gpt", schedule, None)
    _check_equivalence(results, "gpt")
    v_shaped = schedule in ("zbv_zero_bubble", "dualpipev")
    want = [[0, 3], [1, 2]] if v_shaped else [[0, 2], [1, 3]]
    assert [res["stages"] for res in results] == want


def _linears(*sizes: int) -> list[nn.Module]:
    """One Linear(n, 1) per size: n + 1 parameters each."""
    return [nn.Linear(n, 1) for n in sizes]


def test_split_stages_balances_parameter_count():
    assert split_stages(_linears(3, 3, 3, 3), 2) == [[0, 1], [2, 3]]
    assert split_stages(_linears(3, 3, 3, 3, 3), 2) == [[0, 1, 2], [3, 4]]
    # One heavy layer gets a stage of its own; the light ones share.
    assert split_stages(_linears(99, 1, 1, 1, 1), 2) == [[0], [1, 2, 3, 4]]
    assert split_stages(_linears(1, 1, 1, 1, 99), 3) == [[0, 1, 2], [3], [4]]
    assert split_stages(_linears(9, 1, 1, 9, 1), 3) == [[0, 1], [2, 3], [4]]
    assert split_stages(nn.Sequential(*_linears(1, 1, 1)), 3) == [[0], [1], [2]]
    assert split_stages(_mlp_chain(), 4) == [[0, 1], [2], [3], [4, 5]]


def test_split_stages_explicit_boundaries():
    assert split_stages(_linears(1, 1, 1, 1, 1), 3, boundaries=[1, 4]) == [[0], [1, 2, 3], [4]]
    assert split_stages(_linears(1, 1), 1, boundaries=[]) == [[0, 1]]


@pytest.mark.parametrize(
    ("num_stages", "boundaries", "match"),
    [
        (5, None, "cannot split 4 layers into 5 pipeline stages"),
        (0, None, "num_stages must be >= 1"),
        (2, [1, 2], r"first layer of stages 1..1 \(1 indices\), got 2"),
        (3, [2, 2], "strictly increasing"),
        (3, [3, 1], "strictly increasing"),
        (2, [0], "strictly increasing layer indices in 1..3"),
        (2, [4], "strictly increasing layer indices in 1..3"),
    ],
)
def test_split_stages_errors(num_stages, boundaries, match):
    with pytest.raises(ValueError, match=match):
        split_stages(_linears(1, 1, 1, 1), num_stages, boundaries=boundaries)


def test_schedule_names():
    assert schedule_class("GPipe")[0] == "gpipe"
    assert schedule_class("Interleaved1F1B")[0] == "interleaved_1f1b"
    assert schedule_class("zbv-zero-bubble")[0] == "zbv_zero_bubble"
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'; valid "
                       "schedules: gpipe, 1f1b, interleaved_1f1b, looped_bfs"):
        schedule_class("pipedream")


def _bad_builds(rank: int, world_size: int) -> list[str]:
    """The message of each bad build_pipeline / step call, in order."""
    group = dist.group.WORLD
    example = torch.zeros(2, 7)
    kwargs = {"pp_group": group, "micro_batches": 2, "loss_fn": mlp_loss,
              "example_inputs": example}
    attempts = [
        lambda: build_pipeline(_mlp_chain(), schedule="pipedream", **kwargs),
        lambda: build_pipeline(_mlp_chain(), schedule="gpipe", stages_per_rank=2, **kwargs),
        lambda: build_pipeline(_mlp_chain(), schedule="zbv_zero_bubble", stages_per_rank=3,
                               **kwargs),
        lambda: build_pipeline(_mlp_chain(), schedule="1f1b", stages_per_rank=7, **kwargs),
        lambda: build_pipeline(_gpt(), schedule="1f1b", **kwargs,
                               layout=PipelineLayout(layers="blocks", last=("ln_f", "head"))),
        lambda: build_pipeline(_gpt(), schedule="1f1b", **kwargs,
                               layout=PipelineLayout(layers="layers")),
        lambda: build_pipeline(_mlp_chain(), schedule="1f1b", **kwargs).step(
            torch.zeros(4, 9), torch.zeros(4, 5)),
        lambda: build_pipeline(_mlp_chain(), schedule="1f1b", **kwargs).step(
            torch.zeros(4, 7), torch.zeros(3, 5)),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


def test_bad_input_errors(run_ranks):
    messages = run_ranks(_bad_builds, 1)[0]
    expected = [
        "unknown pipeline schedule 'pipedream'; valid schedules: gpipe, 1f1b,",
        "schedule 'gpipe' runs one stage per rank, got stages_per_rank=2",
        "schedule 'zbv_zero_bubble' runs exactly two stages per rank, got stages_per_rank=3",
        "schedule '1f1b' runs one stage per rank, got stages_per_rank=7",
        "leaves 2 tensors on no stage: tok_emb.weight, pos_emb.weight;",
        "PipelineLayout.layers='layers' is not a submodule of GPT",
        "input 0: expected (4, 7) torch.float32 (micro_batches=2 x example_inputs (2, 7)), "
        "got (4, 9)",
        "targets of shape (3, 5): dim 0 must split into micro_batches=2",
    ]
    for got, want in zip(messages, expected, strict=True):
        assert want in got, (want, got)

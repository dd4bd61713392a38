"""Rank functions of the compile tests (issue 35): train meshzero's compiled units on the
DeepSpeed batch convention of tests.models and return what the tests compare, with dynamo's
own counts (engine.compile_report()) after each step."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import meshzero
from meshzero.demo.gpt import GPT, GPTConfig
from meshzero.demo.gpt import loss_fn as gpt_loss
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import Batch, reference_train, split_for_rank

VOCAB, SEQ, STEPS, N_LAYER = 32, 8, 3, 3
TINY = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=N_LAYER, n_head=2, n_embd=16)


class CheckpointedGPT(GPT):
    """The demo GPT with each block under torch.utils.checkpoint (non-reentrant)."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def build_gpt(checkpointed: bool = False) -> GPT:
    torch.manual_seed(0)
    return CheckpointedGPT(TINY) if checkpointed else GPT(TINY)


def gpt_batches(global_batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen)
        out.append((tokens, (3 * tokens + 1) % VOCAB))
    return out


def gpt_reference(global_batch: int, *, grad_accum: int = 1, clip: float = 0.0,
                  dtype: torch.dtype = torch.float32) -> Any:
    """Plain torch, one process, the whole global batch (tests/models.reference_train)."""
    return reference_train(build_gpt, gpt_batches(global_batch), lr=1e-2, eps=ADAM_EPS,
                           weight_decay=0.01, grad_accum=grad_accum, clip=clip, dtype=dtype,
                           loss_fn=gpt_loss)


def compiled_config(stage: int, *, global_batch: int, grad_accum: int = 1,
                    backend: str = "aot_eager", **extra: Any) -> dict:
    return zero_config(stage, global_batch=global_batch, grad_accum=grad_accum,
                       compile={"enabled": True, "backend": backend}, **extra)


BAD_CALLS = ({"backend": "no_such"}, {"compile_kwargs": {"fullgrap": True}},
             {"schedule": [(0, "z3")]}, {"compiled_autograd_enabled": True})


def _refusals(engine: Any) -> list[str]:
    """What engine.compile() says to each of BAD_CALLS (a ValueError each, nothing done)."""
    errors = []
    for kwargs in BAD_CALLS:
        try:
            engine.compile(**kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def train_compiled(rank: int, world_size: int, configs: list[dict], *,
                   checkpointed: bool = False) -> list[dict]:
    """For each config (a fresh dynamo cache each): train STEPS steps of the tiny GPT and
    return its params, losses and the compile report after every step. A config's
    ``"_call"``: compile with ``engine.compile(**call)`` instead of the config's section;
    before it, the refusals of BAD_CALLS are recorded."""
    out = []
    for cfg in configs:
        torch._dynamo.reset()
        cfg = copy.deepcopy(cfg)
        call, probe = cfg.pop("_call", None), cfg.pop("_probe", False)
        engine, *_ = meshzero.initialize(model=build_gpt(checkpointed), config=cfg)
        refusals = []
        if call is not None:
            refusals = _refusals(engine)
            assert not engine.is_compiled and engine.compile_report()["units"] == 0
            engine.compile(**call)
        gas = engine.gradient_accumulation_steps()
        losses, reports = [], []
        for batch in gpt_batches(engine.train_batch_size()):
            total = 0.0
            for micro in range(gas):
                x, y = split_for_rank(batch, rank, world_size, gas, micro)
                loss = gpt_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / gas
            losses.append(total)
            reports.append(engine.compile_report())
        out.append({"params": engine.full_state_dict(), "losses": losses, "reports": reports,
                    "compiled": engine.is_compiled, "refusals": refusals})
        if probe:
            out[-1]["probe"] = _shorter_step(engine, rank, world_size)
        if engine.last_profile is not None:  # the flops profiler's report, as printed
            out[-1]["profile"] = (engine.last_profile.compile, str(engine.last_profile))
        engine.close()
    return out


def _shorter_step(engine: Any, rank: int, world_size: int) -> dict:
    """One more step on sequences one token shorter: dynamo recompiles the blocks (a size
    guard); returns the WARNINGs meshzero logged and the report after."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("meshzero.compile.units")
    log.addHandler(handler)
    try:
        x, y = split_for_rank(gpt_batches(engine.train_batch_size())[0], rank, world_size, 1, 0)
        engine.backward(gpt_loss(engine(x[:, :-1]), y[:, :-1]))
        engine.step()
    finally:
        log.removeHandler(handler)
    return {"warnings": [r.getMessage() for r in records], "report": engine.compile_report()}


def assert_compiled_once(reports: list[dict], units: int, first_step: int) -> None:
    """0 graph breaks, one frame for all the identical blocks, nothing compiled after the
    first step that ran compiled (``first_step``: 0, or 1 at stage 3, whose first step runs
    the units eager), all from dynamo's counters."""
    last = reports[-1]
    assert last["units"] == units and not last["eager_units"], last
    assert last["graph_breaks"] == 0, last
    assert last["frames"] == 1 and last["recompiles"] == 0, last
    settled = reports[first_step]
    for key in ("graph_breaks", "recompiles", "frames"):
        assert last[key] == settled[key], (key, reports)
    assert sum(u["frames"] for u in last["per_unit"].values()) == 1, last

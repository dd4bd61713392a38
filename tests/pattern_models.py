"""Model patterns that broke ZeRO and FSDP users, each as a tiny model and a training step.

A :class:`Pattern` is a model, the loss of one micro-step (which may use the model outside
its ``forward``), and what is expected at each stage: equality with plain torch, or a
documented error. ``tests/test_patterns.py`` trains every pattern with meshzero and with one
plain-torch process and compares (docs/models.md lists the same table).

Every pattern sees the same data: a global batch of ``GLOBAL_BATCH`` rows per step, cut
into ranks and micro-steps as in tests.models.split_for_rank. The reference runs the same
cuts one after the other (loss / (world * grad_accum) each), which is the global batch for
every model whose rows are independent, and DDP's semantics for BatchNorm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIM = 8
OUT = 4
GLOBAL_BATCH = 16
VOCAB = 32
SEQ = 6


@dataclasses.dataclass
class Ctx:
    """What a pattern's loss may look at: the rank whose data it is, the step and micro-step,
    and ``gathered(params)`` (``engine.gathered`` under meshzero, nothing in plain torch)."""

    rank: int
    step: int
    micro: int
    gathered: Callable[[Any], Any] = lambda params: nullcontext()


class Lin(nn.Module):
    """Linear + tanh: the repeated block most patterns stack (ModuleList -> ZeRO units)."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    """input Linear -> ``n`` blocks (``block`` factory) -> head; ``order`` picks the blocks run."""

    def __init__(self, n: int = 3, block: Callable[[], nn.Module] = Lin, order=None):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(DIM, OUT)
        self.order = list(range(n)) if order is None else order

    def hidden(self, x):
        h = self.inp(x)
        for i in self.order:
            h = self.blocks[i](h)
        return h

    def forward(self, x):
        return self.head(self.hidden(x))


def mse(out, y):
    return F.mse_loss(out, y)


# -- models of the patterns ------------------------------------------------------------------
class TwoDtypes(Stack):
    """int64 and bool buffers beside fp32 weights (BatchNorm's counter, position ids, masks)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("positions", torch.arange(DIM))
        self.register_buffer("mask", torch.arange(DIM) % 3 != 0)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM, dtype=torch.float64))

    def forward(self, x):
        x = x[:, self.positions] * self.mask * self.scale.float()
        return super().forward(x)


class ParentUsesChild(Stack):
    def forward(self, x):
        h = self.hidden(x)
        return self.head(F.linear(h, self.blocks[1].fc.weight))  # a child unit's weight


class BiasBlock(nn.Module):
    """Returns its own bias for the caller to add: the bias is used after the block returns."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM, bias=False)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)

    def forward(self, x):
        return torch.tanh(self.fc(x)), self.bias


class ReturnsBias(Stack):
    def __init__(self):
        super().__init__(block=BiasBlock)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            out, bias = block(h)
            h = out + bias
        return self.head(h)


class RecursiveBlock(Lin):
    def forward(self, x, depth: int = 2):
        x = torch.tanh(self.fc(x))
        return self(x, depth - 1) if depth > 0 else x


class Recursive(Stack):
    def __init__(self):
        super().__init__(block=RecursiveBlock)


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    extra: dict


class DataclassBlock(Lin):
    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return BlockOut(h, {"square": [h * h]})


class DataclassOut(Stack):
    def __init__(self):
        super().__init__(block=DataclassBlock)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            out = block(h)
            h = out.hidden + 0.1 * out.extra["square"][0]
        return self.head(h)


class Pair(NamedTuple):
    main: torch.Tensor
    side: torch.Tensor


class TupleBlock(Lin):
    def forward(self, x):
        h = self.fc(x)
        return Pair(torch.tanh(h), torch.sigmoid(h))


class NamedTupleOut(Stack):
    def __init__(self):
        super().__init__(block=TupleBlock)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            pair = block(h)
            h = pair.main * pair.side
        return self.head(h)


class DetachBlock(Lin):
    def forward(self, x):
        # the weight also used without its gradient, first: that use's backward runs after
        # the weight's gradient is in (and the unit would have been released)
        side = 0.1 * x @ self.fc.weight.detach().t()
        return side + torch.tanh(self.fc(x))


class RankBranch(Stack):
    """Rank-dependent control flow: the data of rank r runs block 1 + r % 2."""

    def forward(self, x, branch: int = 0):
        h = self.blocks[0](self.inp(x))
        return self.head(self.blocks[1 + branch](h))


class Frozen(Stack):
    """Frozen blocks interleaved with trainable ones (blocks 0 and 2 frozen)."""

    def __init__(self, n: int = 4):
        super().__init__(n=n)
        for i in range(0, n, 2):
            self.blocks[i].requires_grad_(False)


class MaskedInput(Stack):
    def forward(self, x, mask):  # mask: (B, DIM) float without grad
        return super().forward(x * mask)


class NoGradLayer(Stack):
    def forward(self, x):
        h = self.blocks[0](self.inp(x))
        with torch.no_grad():
            frozen_path = self.blocks[1](h)
        return self.head(self.blocks[2](h) + frozen_path)


class Unused(Stack):
    """blocks[2] and ``spare`` never run; the blocks' second output is dropped."""

    def __init__(self):
        super().__init__(block=TupleBlock, order=[0, 1])
        self.spare = nn.Linear(DIM, 3)

    def hidden(self, x):
        h = self.inp(x)
        for i in self.order:
            h = self.blocks[i](h).main
        return h


class DictBlock(Lin):
    def forward(self, state: dict):
        h = torch.tanh(self.fc(state["h"]))
        return {"h": h, "skip": state["skip"] + h}


class DictActivations(Stack):
    def __init__(self):
        super().__init__(block=DictBlock)

    def forward(self, x):
        h = self.inp(x)
        state = {"h": h, "skip": torch.zeros_like(h)}
        for block in self.blocks:
            state = block(state)
        return self.head(state["h"] + state["skip"])


class ListBlock(Lin):
    def forward(self, hs: list):
        return [*hs, torch.tanh(self.fc(hs[-1]))]


class ListActivations(Stack):
    def __init__(self):
        super().__init__(block=ListBlock)

    def forward(self, x):
        hs = [self.inp(x)]
        for block in self.blocks:
            hs = block(hs)
        return self.head(sum(hs))


class NoInputs(Stack):
    """forward() takes nothing: a learned input goes through the blocks."""

    def __init__(self):
        super().__init__()
        self.start = nn.Parameter(torch.randn(GLOBAL_BATCH // 8, DIM))

    def forward(self):
        return super().forward(self.start)


class BranchPerMicro(Stack):
    def forward(self, x, micro: int = 0):
        h = self.blocks[micro % 2](self.inp(x))
        return self.head(self.blocks[2](h))


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 1)
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x):  # (B, DIM, L)
        return torch.relu(self.bn(self.conv(x)))


class BatchNormNet(Stack):
    def __init__(self):
        super().__init__(block=BNBlock)

    def forward(self, x):  # (B, DIM) -> (B, DIM, 2) so BN sees two values per channel
        h = self.inp(x).unsqueeze(-1).expand(-1, -1, 2).contiguous()
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(-1))


class OddParams(Stack):
    """A 0-d, an empty and a non-contiguous parameter."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.3))
        self.empty = nn.Parameter(torch.zeros(0, DIM))
        self.mix = nn.Parameter(torch.randn(DIM, DIM).t() * 0.3)  # transposed view

    def forward(self, x):
        h = self.hidden(x) @ self.mix + self.empty.sum()
        return self.head(h) * self.temperature


class MoE(nn.Module):
    """Top-1 routing over 4 experts with a load-balancing aux loss; every expert runs, on the
    rows routed to it (possibly none), so every rank runs the same modules."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(Lin() for _ in range(experts))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        h = self.inp(x)
        probs = self.router(h).softmax(-1)  # (B, E)
        choice = probs.argmax(-1)  # (B,)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            picked = h.index_select(0, rows)
            out = out.index_add(0, rows, expert(picked) * probs[rows, e:e + 1])
        load = F.one_hot(choice, len(self.experts)).float().mean(0)
        aux = (load * probs.mean(0)).sum() * len(self.experts)
        return self.head(out), aux


class CheckpointFrozenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return checkpoint(lambda t: torch.tanh(self.fc(torch.tanh(self.frozen(t)))), x,
                          use_reentrant=False)


class TiedAcrossUnits(Stack):
    def __init__(self):
        super().__init__()
        self.blocks[2].fc.weight = self.blocks[0].fc.weight


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


# -- the table --------------------------------------------------------------------------------
Loss = Callable[[Callable, nn.Module, torch.Tensor, torch.Tensor, Ctx], torch.Tensor]


def plain(call, module, x, y, ctx):
    return mse(call(x), y)


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    build: Callable[[], nn.Module]
    loss: Loss = plain
    grad_accum: int = 1
    backwards_per_step: int = 1
    config: dict = dataclasses.field(default_factory=dict)
    # stage -> (exception class name, text the message must contain)
    errors: dict = dataclasses.field(default_factory=dict)
    tokens: bool = False  # integer token inputs (the HF model) instead of float rows
    world4: bool = False  # also at world size 4 in the default suite
    pass_parameters: bool = False  # initialize(model_parameters=model.parameters())
    after_initialize: Callable[[nn.Module], None] | None = None
    step_without_backward: bool = False  # an extra engine.step() before the first backward
    # before each micro-step's forward: schedule(model, step, micro) (requires_grad toggles)
    schedule: Callable[[nn.Module, int, int], None] | None = None


def _regularizer(call, module, x, y, ctx):
    reg = sum(p.pow(2).sum() for p in module.blocks[0].parameters())
    return mse(call(x), y) + 1e-2 * reg


def _gathered_regularizer(call, module, x, y, ctx):
    weight = module.blocks[1].fc.weight
    with ctx.gathered([weight]):
        reg = weight.abs().sum()
    return mse(call(x), y) + 1e-2 * reg


def _head_outside(call, module, x, y, ctx):
    return mse(module.head(call(x)), y)  # forward returns the hidden state


def _eval_between(call, module, x, y, ctx):
    module.eval()
    with torch.no_grad():
        call(x * 2)
    module.train()
    return mse(call(x), y)


def _masked(call, module, x, y, ctx):
    return mse(call(x, (x > 0).float()), y)


def _rank_branch(call, module, x, y, ctx):
    return mse(call(x, branch=ctx.rank % 2), y)


def _branch_micro(call, module, x, y, ctx):
    return mse(call(x, micro=ctx.micro), y)


def _no_inputs(call, module, x, y, ctx):
    return mse(call(), y[: GLOBAL_BATCH // 8])


def _moe(call, module, x, y, ctx):
    out, aux = call(x)
    return mse(out, y) + 0.01 * aux


def _tokens(call, module, x, y, ctx):
    out = call(input_ids=x)
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def _unfreeze(model: nn.Module) -> None:
    model.blocks[0].requires_grad_(True)


def _freeze_later(model: nn.Module) -> None:
    model.blocks[1].requires_grad_(False)


def _frozen_first() -> nn.Module:
    model = Stack()
    model.blocks[0].requires_grad_(False)
    return model


class Gan(nn.Module):
    """A generator (two units) feeding a discriminator (two units and a head): one model
    whose halves are frozen in turn (tests/test_requires_grad.py trains it as two engines)."""

    def __init__(self):
        super().__init__()
        self.gen = nn.ModuleList(Lin() for _ in range(2))
        self.disc = nn.ModuleList(Lin() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        for block in [*self.gen, *self.disc]:
            x = block(x)
        return self.head(x)


def _gan_alternating(model: nn.Module, step: int, micro: int) -> None:
    """Even steps train the generator (discriminator and head frozen), odd ones the rest."""
    model.gen.requires_grad_(step % 2 == 0)
    model.disc.requires_grad_(step % 2 == 1)
    model.head.requires_grad_(step % 2 == 1)


def _frozen_backbone() -> nn.Module:
    model = Stack()
    model.inp.requires_grad_(False)
    model.blocks.requires_grad_(False)
    return model


def _progressive(model: nn.Module, step: int, micro: int) -> None:
    """ULMFiT: the head alone, then the last block and the input bias join (the input
    weight, in the same frozen flat group, stays frozen), then everything."""
    if step == 1:
        model.blocks[2].requires_grad_(True)
        model.inp.bias.requires_grad_(True)
    if step == 2:
        model.requires_grad_(True)


def _freeze_then_unfreeze(model: nn.Module, step: int, micro: int) -> None:
    """Block 1 and the head's bias (a fragment in the middle of the root's shard) frozen at
    step 1 only: at step 2 their Adam state (step count 1) is used again."""
    model.blocks[1].requires_grad_(step != 1)
    model.head.bias.requires_grad_(step != 1)


def _toggle_per_micro(model: nn.Module, step: int, micro: int) -> None:
    """Two micro-steps per step: block 0 frozen in the first only (it has a gradient in the
    window: stepped), block 1 in both at step 1 (none: skipped)."""
    model.blocks[0].requires_grad_(micro == 1)
    model.blocks[1].requires_grad_(step != 1)


class LazyInput(Stack):
    """``nn.LazyLinear``: its weight gets a shape in the first forward only."""

    def __init__(self):
        super().__init__()
        self.inp = nn.LazyLinear(DIM)


HEAD_OUTSIDE = type("HeadOutside", (Stack,), {"forward": Stack.hidden})
LAZY = ("ValueError", "module 'inp' (LazyLinear) has an uninitialized parameter 'weight' (a "
        "lazy module): run one forward on an example batch before meshzero.initialize")
ORDER = ("GatherOrderError", "every rank must run the same units")

PATTERNS: list[Pattern] = [
    Pattern("plain_stack", Stack, world4=True),
    Pattern("two_dtypes_buffers", TwoDtypes, world4=True),
    Pattern("two_backwards_one_step", Stack, backwards_per_step=2, world4=True),
    Pattern("parent_uses_child_weight", ParentUsesChild, world4=True),
    Pattern("block_returns_own_bias", ReturnsBias, world4=True),
    Pattern("regularizer_in_training_loop", Stack, loss=_regularizer),
    Pattern("gathered_context_regularizer", Stack, loss=_gathered_regularizer),
    Pattern("head_called_outside_forward", HEAD_OUTSIDE, loss=_head_outside, world4=True),
    Pattern("recursive_module", Recursive),
    Pattern("dataclass_output", DataclassOut, world4=True),
    Pattern("namedtuple_output", NamedTupleOut),
    Pattern("detached_weight_use", lambda: Stack(block=DetachBlock), world4=True),
    Pattern("rank_dependent_branch", RankBranch, loss=_rank_branch, errors={3: ORDER},
            world4=True),
    Pattern("unfrozen_after_initialize", _frozen_first, after_initialize=_unfreeze),
    Pattern("frozen_after_initialize", Stack, after_initialize=_freeze_later),
    Pattern("gan_alternating_requires_grad", Gan, schedule=_gan_alternating, world4=True),
    Pattern("progressive_unfreezing", _frozen_backbone, schedule=_progressive, world4=True),
    Pattern("freeze_then_unfreeze_keeps_state", Stack, schedule=_freeze_then_unfreeze,
            world4=True),
    Pattern("requires_grad_per_micro_step", Stack, schedule=_toggle_per_micro, grad_accum=2),
    Pattern("model_parameters_with_frozen", Frozen, pass_parameters=True),
    Pattern("step_without_backward", Stack, step_without_backward=True),
    Pattern("module_called_in_loop", lambda: Stack(order=[0, 0, 0, 1])),
    Pattern("reused_out_of_order", lambda: Stack(order=[2, 0, 1, 0, 2])),
    Pattern("tied_across_units", TiedAcrossUnits, world4=True),
    Pattern("interleaved_frozen_layers", Frozen),
    Pattern("input_without_grad", MaskedInput, loss=_masked),
    Pattern("layer_under_no_grad", NoGradLayer),
    Pattern("unused_module_and_output", Unused),
    Pattern("dict_activations", DictActivations),
    Pattern("list_activations", ListActivations),
    Pattern("forward_without_inputs", NoInputs, loss=_no_inputs),
    Pattern("eval_forward_between_steps", Stack, loss=_eval_between),
    Pattern("branch_per_micro_step", BranchPerMicro, loss=_branch_micro, grad_accum=2,
            world4=True),
    Pattern("batchnorm", BatchNormNet),
    Pattern("zero_dim_empty_noncontiguous", OddParams),
    Pattern("below_persistence_threshold", Stack,
            config={"zero_optimization": {"stage3_param_persistence_threshold": 10}}),
    Pattern("moe_routing_aux_loss", MoE, loss=_moe, world4=True),
    Pattern("checkpoint_with_frozen_layer", lambda: Stack(block=CheckpointFrozenBlock)),
    Pattern("hf_gpt2_model_output", tiny_gpt2, loss=_tokens, tokens=True),
    Pattern("lazy_module_not_run", LazyInput, errors={s: LAZY for s in range(4)}),
]
BY_NAME = {p.name: p for p in PATTERNS}
